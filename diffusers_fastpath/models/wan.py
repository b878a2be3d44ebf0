"""Wan adapter: diffusers' ``WanTransformer3DModel`` (Wan 2.1 and 2.2: T2V, I2V, TI2V; the 14B and 1.3B/5B
configs), through the shared pieces.

Wan's ``WanTransformerBlock`` keeps its residual stream in the model's dtype but computes each gated residual in
fp32: ``(hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)``, with the gate a chunk of the fp32
``scale_shift_table + temb.float()``. Both such lines (self-attention, FFN) are rewritten from the installed diffusers
source (`diffusers_fastpath.models._chains`) into the fused `gated_residual_fp32`: one kernel reading the bf16
stream, the bf16 update and the fp32 gate, with eager's fp32 product and sum and one rounding (eager: a cast, a
multiply, a cast, an add and a cast, over 32,760 x 5,120 elements at 832x480x81). Wan 2.2 TI2V's per-token gates
(``[B, L, D]`` of row stride 6D) go to the same kernel.

Its two adaLN sites, ``(self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)``
and ``norm3``'s, go to the fused `layernorm_scale_shift_fp32`: the LayerNorm kernel reading the bf16 stream, its
statistics those of aten's fp32 LayerNorm, the normalised value and the modulate in fp32, one rounding (verified
against eager on its first call per dtype and width).

The attention processor (``WanAttnProcessor``) is rewritten too: the rotary function it defines,
``apply_rotary_emb(x, freqs_cos, freqs_sin)`` (Wan's own pairing: ``x1 * cos - x2 * sin`` and ``x1 * sin + x2 * cos``
with ``cos[..., 0::2]``, ``sin[..., 1::2]``, in fp32, written into a tensor of x's dtype), runs for q and k as
`diffusers_fastpath.ops.rotary_emb_wan` (the rotary kernel with that pairing, exact by construction) where its source
has the digest below (else as written). Eager spends ten kernels per call on it, in fp32 over 32,760 x 5,120 elements
at 832x480x81.

``norm2`` before the cross-attention, ``self.norm2(hidden_states.float()).type_as(hidden_states)`` (an
``FP32LayerNorm`` with weight and bias; ``nn.Identity`` in models built without ``cross_attn_norm``), goes to the fused
`layernorm_affine_fp32`: the same LayerNorm kernel with aten's affine epilogue in fp32 and one rounding (self-verified;
eager runs an upcast copy, the fp32 LayerNorm and a downcast copy over 32,760 x 5,120 elements).

The self-attention's QK norms (``torch.nn.RMSNorm(5120)`` across all heads, before the ``unflatten`` into heads)
wait for that rotary (the rewriter's QK-norm form) and run with it as `diffusers_fastpath.ops.qk_norm_rows_rope`
(the rotary kernel's row norm in aten's order, self-verified; falling back to the norm and the fused rotary).

Per Wan 2.1 14B step (40 blocks): 80 gated residual and 80 LayerNorm + modulate sites, 40 ``norm2`` sites, 40 QK norm
+ rotary sites (the self-attentions; q and k each) with their 40 rotary fallback sites. Not fused yet (issue 15): the
cross-attention's plain residual and QK norms, the GELUs.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanTransformer3DModel,
    WanTransformerBlock,
)

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, replace_processors, swap_rewritten

# sha256[:16] of ast.unparse of the apply_rotary_emb that diffusers 0.42.1's WanAttnProcessor.__call__ defines,
# `rotary_emb_wan_ref`'s expression
_ROTARY = ("apply_rotary_emb", "249c95ee27579fd4")

# Created at import, so that a pickled patched model finds it here by name.
FastpathWanTransformerBlock, _BLOCK = fused_subclass(WanTransformerBlock, "FastpathWanTransformerBlock", __name__)
FastpathWanAttnProcessor, _PROCESSOR = fused_subclass(WanAttnProcessor, "FastpathWanAttnProcessor", __name__,
                                                      "__call__", wan_rotary=_ROTARY)


@register_adapter(WanTransformer3DModel)
def patch_wan(model: WanTransformer3DModel, state: PatchState) -> None:
    """Swap Wan's blocks and self-attention processors for their chain-fused subclasses (see module doc)."""
    swap_rewritten(state, model, {WanTransformerBlock: (FastpathWanTransformerBlock, _BLOCK)})
    # the self-attentions: the cross-attentions (attn2) get no rotary table
    replace_processors(state, model, WanAttention, WanAttnProcessor, FastpathWanAttnProcessor, attribute="attn1")
