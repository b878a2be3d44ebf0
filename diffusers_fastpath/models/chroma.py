"""Chroma adapter: diffusers' ``ChromaTransformer2DModel`` (Chroma1-HD, Chroma1-Base, Chroma1-Flash).

Chroma is FLUX.1's architecture with the per-block adaLN projections pruned into one ``distilled_guidance_layer``:
its blocks take their modulation rows as input. Everything it shares with FLUX.1 is fused by the same pieces, and
nothing of its own is copied here:

- the inline chains of its four forwards (``ChromaAdaLayerNormZeroPruned``, ``ChromaAdaLayerNormZeroSinglePruned``,
  ``ChromaTransformerBlock``, ``ChromaSingleTransformerBlock``) are rewritten from the installed diffusers source by
  `diffusers_fastpath.models._chains`: every adaLN LayerNorm + modulate runs as the fused `layernorm_scale_shift`,
  every gated residual as the fused `gated_residual`, and each single block's tanh-GELU with the attention/MLP
  concatenation as the fused `gelu_cat`;
- its attention is FLUX's (``FluxAttention`` with ``FluxAttnProcessor``): the fused `FastpathFluxAttnProcessor`
  (QK RMSNorm + concatenation + rotary in one `qk_norm_rope` each), also with Chroma's attention mask;
- ``FluxPosEmbed`` builds the rotary tables once per forward, as in FLUX.1.

Per Chroma1-HD step (19 dual + 38 single blocks): 114 LayerNorm + modulate sites (19 x 2 in the dual blocks' adaLN
modules, 38 in the single blocks', 19 x 2 ``norm2``/``norm2_context``), 114 gated residual sites, 38 GELU +
concatenation sites, 57 attention processors. Not fused yet: the FFN GELUs of the ``"high"`` tier, and the text/image
concatenation FLUX.1 saves between single blocks (Chroma concatenates once, before them).
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_chroma import (
    ChromaAdaLayerNormZeroPruned,
    ChromaAdaLayerNormZeroSinglePruned,
    ChromaSingleTransformerBlock,
    ChromaTransformer2DModel,
    ChromaTransformerBlock,
)

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, swap_rewritten
from .flux import patch_flux_attention

# Created at import, so that a pickled patched model finds them here by name.
FastpathChromaAdaLayerNormZeroPruned, _ADALN = fused_subclass(
    ChromaAdaLayerNormZeroPruned, "FastpathChromaAdaLayerNormZeroPruned", __name__)
FastpathChromaAdaLayerNormZeroSinglePruned, _ADALN_SINGLE = fused_subclass(
    ChromaAdaLayerNormZeroSinglePruned, "FastpathChromaAdaLayerNormZeroSinglePruned", __name__)
FastpathChromaTransformerBlock, _BLOCK = fused_subclass(ChromaTransformerBlock, "FastpathChromaTransformerBlock", __name__)
FastpathChromaSingleTransformerBlock, _SINGLE_BLOCK = fused_subclass(
    ChromaSingleTransformerBlock, "FastpathChromaSingleTransformerBlock", __name__)

_SWAPS = {
    ChromaAdaLayerNormZeroPruned: (FastpathChromaAdaLayerNormZeroPruned, _ADALN),
    ChromaAdaLayerNormZeroSinglePruned: (FastpathChromaAdaLayerNormZeroSinglePruned, _ADALN_SINGLE),
    ChromaTransformerBlock: (FastpathChromaTransformerBlock, _BLOCK),
    ChromaSingleTransformerBlock: (FastpathChromaSingleTransformerBlock, _SINGLE_BLOCK),
}


@register_adapter(ChromaTransformer2DModel)
def patch_chroma(model: ChromaTransformer2DModel, state: PatchState) -> None:
    """Swap Chroma's adaLN modules and blocks for their chain-fused subclasses and its attention processors for
    FLUX's fused one (see module doc)."""
    swap_rewritten(state, model, _SWAPS)
    patch_flux_attention(model, state)
