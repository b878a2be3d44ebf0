"""Z-Image adapter: diffusers' ``ZImageTransformer2DModel`` (Z-Image, Z-Image-Turbo), through the shared pieces.

Z-Image's ``ZImageTransformerBlock`` modulates with RMSNorms (``attention_norm1(x) * scale_msa``) and adds its
branches through a tanh gate: ``x = x + gate_msa * self.attention_norm2(attn_out)`` and the same for the FFN. Its
forward is rewritten from the installed diffusers source (`diffusers_fastpath.models._chains`, the sandwich-norm
forms), in every modulated block (the main layers and the noise refiner; the context refiner's blocks have no
modulation and stay as they are):

- each branch input, ``self.attention_norm1(x) * scale_msa`` and ``self.ffn_norm1(x) * scale_mlp``, as the fused
  `rmsnorm_scale` (diffusers' RMSNorm and the scale in one pass, aten's reduction order, self-verified);
- each branch output, ``x + gate * self.attention_norm2(attn_out)`` and the FFN's, as the fused
  `rmsnorm_gated_residual` (where its norm cannot run fused, the norm runs as written and the gated residual is the
  exact fused `gated_residual`); per-token gates and scales (the omni mode's noisy/clean tokens, picked by
  ``select_per_token``) are read through an index, never written out (`_chain_token_rows`: `rmsnorm_scale_rows`,
  `rmsnorm_gated_residual_rows`).

Every block's ``FeedForward`` (the context refiner's too) has its SwiGLU gating, ``F.silu(x1) * x3`` in
``_forward_silu_gating``, rewritten into the fused `silu_mul` (its SiLU proven on every bf16/fp16 value on first use).

Its attention processor, ``ZSingleStreamAttnProcessor``, defines its complex-form rotary as a local function
(``apply_rotary_emb(x_in, freqs_cis)``: ``view_as_complex(x_in.float()) * freqs_cis.unsqueeze(2)``); where that
function's source is the one this package knows (digest of ``ast.unparse``), the processor is rewritten: each QK norm
(diffusers' ``RMSNorm`` over each head) waits for the rotary call after it, and the two run as the fused
`rmsnorm_rope_complex` (Qwen-Image's op, with Z-Image's per-sample ``[B, S, D/2]`` factors).

Per Z-Image step (30 layers, 2 noise-refiner and 2 context-refiner blocks): 64 RMSNorm + scale, 64 RMSNorm + gated
residual, 34 SwiGLU and 34 QK norm + rotary sites (two calls each: q and k).
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_z_image import (FeedForward, ZImageTransformer2DModel,
                                                                ZImageTransformerBlock, ZSingleStreamAttnProcessor)

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, replace_processors, swap_rewritten

# sha256[:16] of ast.unparse of the processor's local `apply_rotary_emb` in diffusers 0.42.1 (rmsnorm_rope_complex's
# complex multiply; the autocast it disables changes nothing for the op, whose dtypes are explicit)
_LOCAL_ROTARY = ("apply_rotary_emb", "eaca8f0d9ea5b1ea")

# Created at import, so that a pickled patched model finds it here by name.
FastpathZImageTransformerBlock, _BLOCK = fused_subclass(
    ZImageTransformerBlock, "FastpathZImageTransformerBlock", __name__,
    rms_norms=("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"))
FastpathZImageFeedForward, _FEED_FORWARD = fused_subclass(FeedForward, "FastpathZImageFeedForward", __name__,
                                                          "_forward_silu_gating", activations=("F.silu",))
FastpathZSingleStreamAttnProcessor, _ = fused_subclass(
    ZSingleStreamAttnProcessor, "FastpathZSingleStreamAttnProcessor", __name__, "__call__", local_rotary=_LOCAL_ROTARY)


@register_adapter(ZImageTransformer2DModel)
def patch_zimage(model: ZImageTransformer2DModel, state: PatchState) -> None:
    """Swap Z-Image's modulated blocks for their chain-fused subclass (see module doc)."""
    replace_processors(state, model, Attention, ZSingleStreamAttnProcessor, FastpathZSingleStreamAttnProcessor)
    if FastpathZImageFeedForward is not None:
        swap_rewritten(state, model, {FeedForward: (FastpathZImageFeedForward, _FEED_FORWARD)})
    swap_rewritten(state, model, {ZImageTransformerBlock: (FastpathZImageTransformerBlock, _BLOCK)},
                   lambda module: module.modulation)
