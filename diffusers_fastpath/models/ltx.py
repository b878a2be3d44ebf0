"""LTX-Video adapter: diffusers' ``LTXVideoTransformer3DModel`` (LTX-Video 0.9.x), through the shared pieces.

LTX-Video's ``LTXVideoTransformerBlock`` normalises with weightless RMSNorms and modulates from a learnt table plus
the timestep embedding, per token. Rewritten from the installed diffusers source (`diffusers_fastpath.models._chains`):

- its two gated residuals (``hidden_states + attn_hidden_states * gate_msa`` and the FFN's) into the fused
  `gated_residual` (the product taken as ``gate * update``: it commutes bit for bit);
- both RMSNorm + modulates, ``norm1`` (``N = self.norm1(X)`` ... ``N = N * (1 + scale_msa) + shift_msa``) and
  ``norm2`` (``self.norm2(X) * (1 + scale_mlp) + shift_mlp``), into `diffusers_fastpath.ops.rmsnorm_modulate`: the
  RMSNorm kernel's T-rounded modulate epilogue over the per-token ``[B, T, D]`` rows, self-verified.

The attention processor (``LTXVideoAttnProcessor``) is rewritten too: its QK norms (``torch.nn.RMSNorm(C)`` across
all heads) wait for the rotary (the rewriter's QK-norm form), and its two calls of LTX's own rotary,
``apply_rotary_emb(x, (cos, sin))`` over the ``[B, S, heads * head_dim]`` rows of q and k with per-sample fp32 tables,
run together with both norms as `diffusers_fastpath.ops.qk_norm_rows_rope_pair` (one kernel reading the tables once:
aten's row-norm order, self-verified), where the installed function's source has the digest below (else as written,
with one warning); its fallbacks are each as `qk_norm_rows_rope`, then the norm as written and
`diffusers_fastpath.ops.rotary_emb_rows` (exact by construction).

Per LTX-Video step (28 blocks): 56 gated residual and 56 RMSNorm + modulate sites, 28 QK norm + rotary pair sites
(the self-attentions) with their 28 rotary fallback sites. Not fused yet (issue 15): the cross-attention's QK norms,
the GELUs.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_ltx import (
    LTXAttention,
    LTXVideoAttnProcessor,
    LTXVideoTransformer3DModel,
    LTXVideoTransformerBlock,
    apply_rotary_emb,
)

from .._state import PatchState, register_adapter
from ._chain_pending import register_rows_rotary
from ._chains import fused_subclass, replace_processors, swap_rewritten
from ._mirror import mirrors

# sha256[:16] of diffusers 0.42.1's transformer_ltx.apply_rotary_emb, `rotary_emb_rows_ref`'s expression
_ROTARY = "fa3a0a3ad5c63101"

# Created at import, so that a pickled patched model finds it here by name.
FastpathLTXVideoTransformerBlock, _BLOCK = fused_subclass(LTXVideoTransformerBlock, "FastpathLTXVideoTransformerBlock",
                                                          __name__)
FastpathLTXVideoAttnProcessor, _ = fused_subclass(LTXVideoAttnProcessor, "FastpathLTXVideoAttnProcessor", __name__,
                                                  "__call__", rows_rotary="apply_rotary_emb")


@register_adapter(LTXVideoTransformer3DModel)
def patch_ltx(model: LTXVideoTransformer3DModel, state: PatchState) -> None:
    """Swap LTX-Video's blocks and attention processors for their chain-fused subclasses (see module doc)."""
    if mirrors(apply_rotary_emb, _ROTARY):  # else the rotary calls run LTX's function as written
        register_rows_rotary(apply_rotary_emb)
    swap_rewritten(state, model, {LTXVideoTransformerBlock: (FastpathLTXVideoTransformerBlock, _BLOCK)})
    # the self-attentions: the cross-attentions (attn2) get no rotary table
    replace_processors(state, model, LTXAttention, LTXVideoAttnProcessor, FastpathLTXVideoAttnProcessor, attribute="attn1")
