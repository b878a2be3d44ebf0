"""Qwen-Image adapter: diffusers' ``QwenImageTransformer2DModel`` (Qwen-Image, Qwen-Image-Edit and -Edit-2509/2511,
Qwen-Image-Layered), through the shared pieces.

Qwen-Image's ``QwenImageTransformerBlock`` is an MMDiT block like FLUX.1's dual block, with its modulates in a method
of its own, ``_modulate(x, mod_params, index=None)``: ``shift, scale, gate = mod_params.chunk(3, dim=-1)``, then
``x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)`` and ``gate.unsqueeze(1)``. Its forward is rewritten from the
installed diffusers source (`diffusers_fastpath.models._chains`):

- each of the four ``self.<norm>(x)`` + ``self._modulate(...)`` pairs (``img_norm1``, ``txt_norm1``, ``img_norm2``,
  ``txt_norm2``) becomes one call of `_modulate_norm` below: the LayerNorm and the modulate as the fused
  `layernorm_scale_shift` (the same products and sums as ``_modulate``, whose installed source is checked by digest;
  with a per-token ``modulate_index``, the Edit-2511 ``zero_cond_t`` models' image stream, it runs diffusers'
  ``_modulate`` itself and the site counts why);
- the four gated residuals (``hidden_states + img_gate1 * img_attn_output`` and the like) as the fused
  `gated_residual`.

Per Qwen-Image step (60 blocks): 240 LayerNorm + modulate sites, 240 gated residual sites. Not fused yet (issue 14):
the attention processor's QK RMSNorms and complex-valued rotary embedding (``apply_rotary_emb_qwen``), the FFN
GELUs, the output ``AdaLayerNormContinuous``.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel, QwenImageTransformerBlock
from torch import nn

from .._state import PatchState, register_adapter, site_attr
from ._chain_calls import norm_modulate
from ._chains import fused_subclass, swap_rewritten
from ._mirror import mirrors, source_digest

# sha256[:16] of diffusers 0.42.1's QwenImageTransformerBlock._modulate, whose index-free path `_modulate_norm`
# computes with the LayerNorm fused in.
_MODULATE = "9ee78b512057d504"
REASON_INDEX = "per-token modulate_index (zero_cond_t)"


def _modulate_norm(self, norm: nn.Module, x, mod_params, index=None):
    """``self._modulate(norm(x), mod_params, index)`` with the LayerNorm and the modulate as one fused op (the site
    on `norm` counts); with a per-token `index`, or operands that are not what the pattern expects, diffusers'
    ``_modulate`` runs itself."""
    site = getattr(norm, site_attr(), None)
    if index is not None or not (isinstance(norm, nn.LayerNorm) and isinstance(x, torch.Tensor)
                                 and isinstance(mod_params, torch.Tensor)):
        if site is not None and index is not None:
            site.fallback[REASON_INDEX] += 1
        return self._modulate(norm(x), mod_params, index)
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    return norm_modulate(norm, x, scale, shift, site), gate.unsqueeze(1)


# Created at import, so that a pickled patched model finds it here by name. The LayerNorm fusion only where the
# installed `_modulate` is the one `_modulate_norm` computes (else: the gated residuals alone).
_MODULATE_MIRRORED = source_digest(QwenImageTransformerBlock._modulate) == _MODULATE
FastpathQwenImageTransformerBlock, _BLOCK = fused_subclass(
    QwenImageTransformerBlock, "FastpathQwenImageTransformerBlock", __name__,
    norm_methods={"_modulate": ("_modulate_norm", _modulate_norm)} if _MODULATE_MIRRORED else None)


@register_adapter(QwenImageTransformer2DModel)
def patch_qwenimage(model: QwenImageTransformer2DModel, state: PatchState) -> None:
    """Swap Qwen-Image's blocks for their chain-fused subclass (see module doc)."""
    mirrors(QwenImageTransformerBlock._modulate, _MODULATE)  # one warning where the LayerNorm fusion was left out
    swap_rewritten(state, model, {QwenImageTransformerBlock: (FastpathQwenImageTransformerBlock, _BLOCK)})
