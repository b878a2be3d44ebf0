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
- ``FluxPosEmbed`` builds the rotary tables once per forward, as in FLUX.1;
- every block expands the forward's ``[B, S]`` attention mask to ``[B, 1, S, S]`` again (``mask[:, None, None, :] *
  mask[:, None, :, None]``: 57 products of 4608 x 4608 per Chroma1-HD step, 2.9 ms); the rewriter's outer-mask form
  has the first block's product kept on the forward's rotary table and handed to the others, the same bits;
- ``ChromaCombinedTimestepTextProjEmbeddings`` embeds its constant guidance 0 from a tensor made on the host and
  copied to the GPU on every forward, a copy from pageable memory that a CUDA graph cannot capture (so
  ``cuda_graphs=True`` ran every Chroma step eager). Its subclass here makes that zero on the timestep's device;
  ``sin(0) = 0`` and ``cos(0) = 1`` on every device, so the rows are the same bits.

Per Chroma1-HD step (19 dual + 38 single blocks): 114 LayerNorm + modulate sites (19 x 2 in the dual blocks' adaLN
modules, 38 in the single blocks', 19 x 2 ``norm2``/``norm2_context``), 114 gated residual sites, 38 GELU +
concatenation sites, 57 attention processors. Not fused yet: the FFN GELUs of the ``"high"`` tier, and the text/image
concatenation FLUX.1 saves between single blocks (Chroma concatenates once, before them), and the boolean mask's
conversion to an additive one that ``scaled_dot_product_attention`` makes in every block (``where``, 2.8 ms a step).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_chroma import (
    ChromaAdaLayerNormZeroPruned,
    ChromaCombinedTimestepTextProjEmbeddings,
    ChromaAdaLayerNormZeroSinglePruned,
    ChromaSingleTransformerBlock,
    ChromaTransformer2DModel,
    ChromaTransformerBlock,
)

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, swap_rewritten
from ._mirror import mirrors
from .flux import patch_flux_attention

# sha256[:16] of diffusers 0.42.1's ChromaCombinedTimestepTextProjEmbeddings.forward, mirrored below.
_TIME_EMBED_FORWARD = "b2748b8b2d737c62"


class FastpathChromaCombinedTimestepTextProjEmbeddings(ChromaCombinedTimestepTextProjEmbeddings):
    """``forward`` mirrors diffusers 0.42.1's (checked by source digest at patch time) with one change: the guidance
    timestep 0 is ``torch.zeros`` on the timestep's device instead of ``torch.tensor([0] * batch_size)`` on the host
    moved there afterwards. Its embedding is ``sin(0 * f) = 0`` and ``cos(0 * f) = 1`` for every frequency ``f``,
    exact on every device, so the output is the same bits; the forward no longer copies from pageable host memory,
    which CUDA graph capture refuses."""

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        mod_index_length = self.mod_proj.shape[0]
        batch_size = timestep.shape[0]

        timesteps_proj = self.time_proj(timestep).to(dtype=timestep.dtype)
        guidance_proj = self.guidance_proj(torch.zeros(batch_size, dtype=torch.long, device=timestep.device)).to(
            dtype=timestep.dtype, device=timestep.device
        )

        mod_proj = self.mod_proj.to(dtype=timesteps_proj.dtype, device=timesteps_proj.device).repeat(batch_size, 1, 1)
        timestep_guidance = (
            torch.cat([timesteps_proj, guidance_proj], dim=1).unsqueeze(1).repeat(1, mod_index_length, 1)
        )
        input_vec = torch.cat([timestep_guidance, mod_proj], dim=-1)
        return input_vec.to(timestep.dtype)


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
    embed = model.time_text_embed
    if type(embed) is ChromaCombinedTimestepTextProjEmbeddings and mirrors(ChromaCombinedTimestepTextProjEmbeddings.forward, _TIME_EMBED_FORWARD):
        state.swap_class(embed, FastpathChromaCombinedTimestepTextProjEmbeddings)
