"""Expert-parallelism tests: the EP layer over gloo ranks against one process and against
megatron-core's MoELayer, and the EP path on one GPU over NCCL."""
