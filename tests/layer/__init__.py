"""MoELayer tests: parity with megatron-core's MoELayer, and the features beyond it."""
