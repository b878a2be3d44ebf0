"""FLUX.1's architecture under other class names: LongCat-Image, Ovis-Image, Bria and Bria-FIBO
(``LongCatImageTransformer2DModel``, ``OvisImageTransformer2DModel``, ``BriaTransformer2DModel``,
``BriaFiboTransformer2DModel``: FLUX's blocks fed a projected text-encoder layer each), one table row each.

Each of these diffusers files carries its own copies of FLUX.1's dual and single blocks, attention module and
attention processor, named after the family, and uses diffusers' shared ``AdaLayerNormZero`` /
``AdaLayerNormZeroSingle``. Nothing of theirs is copied here:

- the shared adaLN modules get FLUX.1's fused subclasses (`flux.patch_adaln`): LayerNorm + modulate in one kernel;
- the blocks' forwards and the processor's ``__call__`` are rewritten from the installed source
  (`diffusers_fastpath.models._chains`): the second adaLN modulate of each dual-block stream as the fused
  `layernorm_scale_shift`, every gated residual as `gated_residual`, and the processor's rotary embedding of q and
  k as the exact fused `rotary_emb` (their QK RMSNorms stay eager: FLUX.1's `qk_norm_rope` processor is
  hand-mirrored, and these processors differ from it in their head reshapes).

The rewritten classes are created at import, as module attributes named ``Fastpath<diffusers name>``, so that a
pickled patched model finds them. A family that the installed diffusers lacks is skipped.
"""

from __future__ import annotations

import importlib

import torch
from diffusers.models.attention_processor import Attention

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, replace_processors, swap_rewritten
from .flux import patch_adaln

# diffusers module (under diffusers.models.transformers) -> the prefix of its class names
FAMILIES = {
    "transformer_longcat_image": "LongCatImage",
    "transformer_ovis_image": "OvisImage",
    "transformer_bria": "Bria",
    "transformer_bria_fibo": "BriaFibo",
}


# each family's attention processor -> its rewritten subclass. A family may run another's processor on diffusers'
# generic `Attention` (Bria-FIBO's single blocks run Bria's): those are swapped too.
_PROCESSORS: dict[type, type | None] = {}


def _fused(cls: type, method: str = "forward"):
    return fused_subclass(cls, f"Fastpath{cls.__name__}", __name__, method)  # an attribute of this module


def _register(module_name: str, prefix: str) -> None:
    try:
        mod = importlib.import_module(f"diffusers.models.transformers.{module_name}")
        model_cls, attention_cls, processor_cls = (getattr(mod, prefix + s) for s in
                                                   ("Transformer2DModel", "Attention", "AttnProcessor"))
        blocks = [getattr(mod, prefix + s) for s in ("TransformerBlock", "SingleTransformerBlock")]
    except (ImportError, AttributeError):  # an older or newer diffusers without this family (or with other names)
        return
    swaps = {cls: _fused(cls) for cls in blocks}
    processor, _ = _fused(processor_cls, "__call__")
    _PROCESSORS[processor_cls] = processor

    def adapter(model: torch.nn.Module, state: PatchState) -> None:
        for module in model.modules():
            patch_adaln(module, state)
        swap_rewritten(state, model, swaps)
        for other, fused in _PROCESSORS.items():  # another family's processor on a generic Attention module
            if other is not processor_cls and fused is not None and any(
                    type(m) is Attention and type(m.processor) is other for m in model.modules()):
                replace_processors(state, model, Attention, other, fused)
        replace_processors(state, model, attention_cls, processor_cls, processor)

    adapter.__name__ = adapter.__qualname__ = f"patch_{prefix}"
    adapter.__doc__ = f"Patch a ``{model_cls.__name__}`` (see `diffusers_fastpath.models.flux_clones`)."
    register_adapter(model_cls)(adapter)


for _module_name, _prefix in FAMILIES.items():
    _register(_module_name, _prefix)
