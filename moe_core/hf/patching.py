"""The transformers patch-mapping route onto the whole-block swap.

:func:`register_patch_mapping` (transformers' ``register_patch_mapping`` with
:func:`patch_mapping`) builds the same blocks as :func:`moe_core.hf.replace_moe_blocks` inside
``from_pretrained`` / ``from_config``: each family's block class name maps to a class that builds
HF's block and returns it swapped.
"""
from typing import Dict, List, Optional

from moe_core.hf.blocks import MoECoreSparseMoeBlock, _build_block, _capacity_fields
from moe_core.hf.families import _FAMILIES


def _family_block_class(block_class_name: str) -> type:
    import importlib

    family = _FAMILIES[block_class_name][0]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, block_class_name)


def patch_mapping(families: Optional[List[str]] = None, aux_loss_coeff: float = 0.0,
                  z_loss_coeff: Optional[float] = None, capacity_factor: Optional[float] = None,
                  pad_to_capacity: bool = False, drop_policy: str = "probs") -> Dict[str, type]:
    """``{HF sparse-MoE block class name: replacement class}`` for transformers'
    ``register_patch_mapping`` / ``apply_patches``.

    A replacement class, called as HF calls its block (``Block(config)``), builds HF's block and
    returns it swapped: the :class:`MoECoreSparseMoeBlock` that :func:`replace_moe_blocks` would
    make (same rules, refusals, names and options), so ``from_pretrained`` / ``from_config``
    build the model with moe-core blocks directly and load checkpoints into them. Its experts
    module is also an instance of the family's HF experts class, so HF's weight initialisation
    reaches it. moe-core's losses (when switched on) are read with :func:`moe_core_losses`; on
    the model's output only after a :func:`replace_moe_blocks` call.

    Args:
        families: model types (``"mixtral"``, ``"qwen3_moe"``, ..., a config's ``model_type``;
            see the family table of :mod:`moe_core.hf.families`); None: all.
        aux_loss_coeff, z_loss_coeff, capacity_factor, pad_to_capacity, drop_policy: as for
            :func:`replace_moe_blocks`.

    Raises:
        ValueError: an unknown family.
    """
    known = {fam: cls_name for cls_name, (fam, _, _) in _FAMILIES.items()}
    # Llama-4's text model's config says "llama4_text"
    wanted = list(known) if families is None else [
        {"llama4_text": "llama4"}.get(f, f) for f in families]
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise ValueError(f"patch_mapping: families {unknown} are not among {sorted(known)}")
    options = dict(aux_loss_coeff=float(aux_loss_coeff), z_loss_coeff=z_loss_coeff,
                   capacity=_capacity_fields(capacity_factor, pad_to_capacity, drop_policy))
    mapping = {}
    for family in wanted:
        cls_name = known[family]
        hf_cls = _family_block_class(cls_name)
        _, rule, shared_names = _FAMILIES[cls_name]

        def __new__(cls, *args, _hf_cls=hf_cls, _family=family, _rule=rule,
                    _shared=shared_names, **kwargs):
            block = _hf_cls(*args, **kwargs)
            return _build_block(block, _family, _rule(block), _shared, hf_experts_class=True,
                                **options)

        name = "MoECore" + cls_name
        # __new__ returns a MoECoreSparseMoeBlock (not of this class: __init__ is not run again)
        mapping[cls_name] = type(name, (MoECoreSparseMoeBlock,),
                                 {"__new__": __new__, "__module__": __name__, "__qualname__": name})
    return mapping


def register_patch_mapping(families: Optional[List[str]] = None, overwrite: bool = False,
                           **options) -> List[str]:
    """Register :func:`patch_mapping` with transformers (``transformers.monkey_patching.
    register_patch_mapping``): afterwards ``from_pretrained`` / ``from_config`` build every
    sparse-MoE block of those families as a moe-core block. Undo with transformers'
    ``unregister_patch_mapping(names)``.

    Args:
        families: as for :func:`patch_mapping`.
        overwrite: transformers' flag (a second registration of a class name raises without it).
        options: :func:`patch_mapping`'s loss and capacity options.

    Returns:
        The HF block class names registered.
    """
    from transformers.monkey_patching import register_patch_mapping as hf_register

    mapping = patch_mapping(families, **options)
    hf_register(mapping, overwrite=overwrite)
    return list(mapping)
