"""megatron-core's moe_utils (the parity oracle's functions), imported quietly.

megatron-core is a hard requirement of the test suite: `make test` installs it, and a missing
install fails the parity tests instead of skipping them."""
import warnings


def megatron_moe_utils():
    """megatron.core.transformer.moe.moe_utils, imported quietly (it warns about TE and apex)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils
    return moe_utils
