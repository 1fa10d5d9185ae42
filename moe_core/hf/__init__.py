"""Hugging Face transformers integration.

Two routes onto moe-core:

* :func:`register_experts_backend` registers the ``"moe_core"`` experts implementation: HF's
  router stays, the experts run on moe-core's permute / grouped GEMM / activation / unpermute ops
  (``from_pretrained(..., experts_implementation="moe_core")``).
* :func:`replace_moe_blocks` swaps each supported family's sparse-MoE block for a moe-core block
  (router, dispatch and experts all moe-core's ``MoELayer`` machinery), keeping HF's parameter
  names, state-dict keys and return type; :func:`register_patch_mapping` (or
  :func:`patch_mapping` with transformers' ``apply_patches``) has ``from_pretrained`` /
  ``from_config`` build those blocks directly.

Modules, each importing only those above it: ``backend`` (the experts implementation), ``router``
(the swap's router, with HF's router interface), ``experts`` (the swap's experts, on HF's
Parameters), ``families`` (the routing rules of each supported family, and the refusals),
``blocks`` (the swapped block and :func:`replace_moe_blocks`), ``patching`` (the
``register_patch_mapping`` route).
"""
from moe_core.hf.backend import BACKEND_NAME, moe_core_experts_forward, register_experts_backend
from moe_core.hf.blocks import MoECoreSparseMoeBlock, moe_core_losses, replace_moe_blocks
from moe_core.hf.families import UnsupportedMoEBlockError
from moe_core.hf.patching import patch_mapping, register_patch_mapping

__all__ = [
    "BACKEND_NAME",
    "moe_core_experts_forward",
    "register_experts_backend",
    "replace_moe_blocks",
    "patch_mapping",
    "register_patch_mapping",
    "MoECoreSparseMoeBlock",
    "UnsupportedMoEBlockError",
    "moe_core_losses",
]
