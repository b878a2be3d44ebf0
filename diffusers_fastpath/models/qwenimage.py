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

CUDA graphs: the model's forward calls diffusers' ``compute_text_seq_len_from_mask`` every step, which makes a CUDA
tensor of a Python int (``torch.as_tensor(text_seq_len, device=...)``: a host-to-device copy, which no capture
takes). While a graph of the forward records, that name is bound to `text_seq_len_on_device` below (the same three
results, the scalar made on the device by ``new_full``; `diffusers_fastpath.graphs.register_capture_twin`); the
first replay is then checked against the eager forward as for every graph.

The attention processor (``QwenDoubleStreamAttnProcessor2_0``) is rewritten too: each of its four QK norms
(diffusers' ``RMSNorm`` over each head) waits for the ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` that
follows it, and the two run as the fused `rmsnorm_rope_complex` (the rewriter's QK-norm form; the installed
``apply_rotary_emb_qwen`` checked by digest; where the norm cannot run fused, both run as written). The text and
image q that ``torch.cat([txt_query, img_query], dim=1)`` joins (and k) wait for that concatenation, and the kernel
writes both streams into the joint tensor (`rmsnorm_rope_complex_cat`, the rewriter's joint form; at batch 1, where
each stream's part of it is contiguous; above, each stream runs fused on its own and the concatenation as written).

Per Qwen-Image step (60 blocks): 240 LayerNorm + modulate sites, 240 gated residual sites, per attention one QK norm +
rotary site and one joint site (q and k: two calls at batch 1). Not fused yet: the concatenation of v, the FFN
GELUs, the output ``AdaLayerNormContinuous``.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
    apply_rotary_emb_qwen,
    compute_text_seq_len_from_mask,
)
from torch import nn

from .. import graphs
from .._state import PatchState, register_adapter, site_attr
from ._chain_calls import norm_modulate
from ._chain_pending import register_complex_rotary
from ._chains import fused_subclass, replace_processors, swap_rewritten
from .._source import source_digest
from ._mirror import mirrors

# sha256[:16] of diffusers 0.42.1's QwenImageTransformerBlock._modulate, whose index-free path `_modulate_norm`
# computes with the LayerNorm fused in.
_MODULATE = "9ee78b512057d504"
REASON_INDEX = "per-token modulate_index (zero_cond_t)"
# ... and of compute_text_seq_len_from_mask, which `text_seq_len_on_device` computes without the host-to-device copy.
_TEXT_SEQ_LEN = "7df03db69ecf3bef"
# ... and of apply_rotary_emb_qwen, whose use_real=False branch `rmsnorm_rope_complex` computes after the norm.
_ROTARY = "62c3cf93c5e4d4eb"


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


def text_seq_len_on_device(encoder_hidden_states, encoder_hidden_states_mask):
    """diffusers' ``compute_text_seq_len_from_mask`` with its one host-to-device copy made on the device: returns
    ``(text_seq_len, per_sample_len, bool mask)``, the same values, dtypes and devices; no mask, or one of the wrong
    shape, goes to diffusers' function itself (``None``s, or its ValueError)."""
    if encoder_hidden_states_mask is None or encoder_hidden_states_mask.shape[:2] != encoder_hidden_states.shape[:2]:
        return compute_text_seq_len_from_mask(encoder_hidden_states, encoder_hidden_states_mask)
    text_seq_len = encoder_hidden_states.shape[1]
    mask = encoder_hidden_states_mask
    if mask.dtype != torch.bool:
        mask = mask.to(torch.bool)
    position_ids = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
    active_positions = torch.where(mask, position_ids, position_ids.new_zeros(()))
    # diffusers: torch.as_tensor(text_seq_len, device=...), a copy from the host; new_full is a fill on the device
    per_sample_len = torch.where(mask.any(dim=1), active_positions.max(dim=1).values + 1,
                                 position_ids.new_full((), text_seq_len))
    return text_seq_len, per_sample_len, mask


if source_digest(compute_text_seq_len_from_mask) == _TEXT_SEQ_LEN:  # else its graphs fail to capture: eager, one warning
    graphs.register_capture_twin(QwenImageTransformer2DModel, transformer_qwenimage, "compute_text_seq_len_from_mask",
                                 text_seq_len_on_device)

# Created at import, so that a pickled patched model finds it here by name. The LayerNorm fusion only where the
# installed `_modulate` is the one `_modulate_norm` computes (else: the gated residuals alone).
_MODULATE_MIRRORED = source_digest(QwenImageTransformerBlock._modulate) == _MODULATE
FastpathQwenImageTransformerBlock, _BLOCK = fused_subclass(
    QwenImageTransformerBlock, "FastpathQwenImageTransformerBlock", __name__,
    norm_methods={"_modulate": ("_modulate_norm", _modulate_norm)} if _MODULATE_MIRRORED else None)
FastpathQwenDoubleStreamAttnProcessor, _ = fused_subclass(
    QwenDoubleStreamAttnProcessor2_0, "FastpathQwenDoubleStreamAttnProcessor", __name__, "__call__",
    complex_rotary="apply_rotary_emb_qwen")


@register_adapter(QwenImageTransformer2DModel)
def patch_qwenimage(model: QwenImageTransformer2DModel, state: PatchState) -> None:
    """Swap Qwen-Image's blocks for their chain-fused subclass (see module doc)."""
    mirrors(QwenImageTransformerBlock._modulate, _MODULATE)  # one warning where the LayerNorm fusion was left out
    if mirrors(apply_rotary_emb_qwen, _ROTARY):  # else the QK norms run as written, before diffusers' rotary
        register_complex_rotary(apply_rotary_emb_qwen)
    swap_rewritten(state, model, {QwenImageTransformerBlock: (FastpathQwenImageTransformerBlock, _BLOCK)})
    replace_processors(state, model, Attention, QwenDoubleStreamAttnProcessor2_0, FastpathQwenDoubleStreamAttnProcessor)
