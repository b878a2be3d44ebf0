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
  exact fused `gated_residual`); per-token gates and scales (the omni mode's noisy/clean tokens) are taken as full
  ``[B, L, D]`` operands.

Every block's ``FeedForward`` (the context refiner's too) has its SwiGLU gating, ``F.silu(x1) * x3`` in
``_forward_silu_gating``, rewritten into the fused `silu_mul` (its SiLU proven on every bf16/fp16 value on first use).

Per Z-Image step (30 layers, 2 noise-refiner and 2 context-refiner blocks): 64 RMSNorm + scale, 64 RMSNorm + gated
residual and 34 SwiGLU sites. Not fused yet (issue 14): the QK RMSNorms and the complex rotary embedding of
``ZSingleStreamAttnProcessor``.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_z_image import (FeedForward, ZImageTransformer2DModel,
                                                                ZImageTransformerBlock)

from .._state import PatchState, register_adapter
from ._chains import add_chain_sites, fused_subclass, warn_nothing_to_fuse

# Created at import, so that a pickled patched model finds it here by name.
FastpathZImageTransformerBlock, _BLOCK = fused_subclass(
    ZImageTransformerBlock, "FastpathZImageTransformerBlock", __name__,
    rms_norms=("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"))
FastpathZImageFeedForward, _FEED_FORWARD = fused_subclass(FeedForward, "FastpathZImageFeedForward", __name__,
                                                          "_forward_silu_gating", activations=("F.silu",))


@register_adapter(ZImageTransformer2DModel)
def patch_zimage(model: ZImageTransformer2DModel, state: PatchState) -> None:
    """Swap Z-Image's modulated blocks for their chain-fused subclass (see module doc)."""
    for module in model.modules():
        if type(module) is FeedForward and FastpathZImageFeedForward is not None:
            state.swap_class(module, FastpathZImageFeedForward)
            add_chain_sites(state, module, _FEED_FORWARD)
        if type(module) is not ZImageTransformerBlock or not module.modulation:
            continue
        if FastpathZImageTransformerBlock is None:
            warn_nothing_to_fuse(ZImageTransformerBlock)
            return
        state.swap_class(module, FastpathZImageTransformerBlock)
        add_chain_sites(state, module, _BLOCK)
