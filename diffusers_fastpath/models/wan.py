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

Per Wan 2.1 14B step (40 blocks): 80 gated residual and 80 LayerNorm + modulate sites. Not fused yet (issue 15):
``norm2`` (an fp32 LayerNorm with an affine, before the cross-attention) and its plain residual, the QK RMSNorms
across heads, Wan's rotary embedding, the GELUs.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, swap_rewritten

# Created at import, so that a pickled patched model finds it here by name.
FastpathWanTransformerBlock, _BLOCK = fused_subclass(WanTransformerBlock, "FastpathWanTransformerBlock", __name__)


@register_adapter(WanTransformer3DModel)
def patch_wan(model: WanTransformer3DModel, state: PatchState) -> None:
    """Swap Wan's blocks for their chain-fused subclass (see module doc)."""
    swap_rewritten(state, model, {WanTransformerBlock: (FastpathWanTransformerBlock, _BLOCK)})
