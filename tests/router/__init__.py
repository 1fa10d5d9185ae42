"""Router tests: top-k routing and the gating linear (vs the references and megatron-core), the
fused aux-loss scores and z-loss, the Hugging Face routing rules, bad input."""
