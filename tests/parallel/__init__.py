"""Data-parallel tests: replicated MoE layers under DDP and FSDP2 over gloo ranks against one
process on the whole batch."""
