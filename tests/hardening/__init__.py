"""Cross-cutting tests: shared guards, overflow and contracts, opcheck, dynamic shapes, CUDA-graph
capture, exact resume, module conventions, and the demo end to end."""
