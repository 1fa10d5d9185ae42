"""A/B and check tools for the kernels and the layer. The A/B tools time one piece two or three
ways in one process, in turns on the same clock (a tuning switch flipped, two versions of the
Hopper grouped GEMM's source, the layer's row paths), and say whether the variants agree bit for
bit; ``gg_sm90_check`` builds the Hopper grouped GEMM standalone and checks it against a float64
reference. They take the reference shapes and the timing harness from ``benchmarks``; each runs
from the repository root as ``python -m tools.<tool>``."""
