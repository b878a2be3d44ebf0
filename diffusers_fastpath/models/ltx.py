"""LTX-Video adapter: diffusers' ``LTXVideoTransformer3DModel`` (LTX-Video 0.9.x), through the shared pieces.

LTX-Video's ``LTXVideoTransformerBlock`` normalises with weightless RMSNorms and modulates from a learnt table plus
the timestep embedding, per token. Rewritten from the installed diffusers source (`diffusers_fastpath.models._chains`):

- its two gated residuals (``hidden_states + attn_hidden_states * gate_msa`` and the FFN's) into the fused
  `gated_residual` (the product taken as ``gate * update``: it commutes bit for bit);
- both RMSNorm + modulates, ``norm1`` (``N = self.norm1(X)`` ... ``N = N * (1 + scale_msa) + shift_msa``) and
  ``norm2`` (``self.norm2(X) * (1 + scale_mlp) + shift_mlp``), into `diffusers_fastpath.ops.rmsnorm_modulate`: the
  RMSNorm kernel's T-rounded modulate epilogue over the per-token ``[B, T, D]`` rows, self-verified.

Per LTX-Video step (28 blocks): 56 gated residual and 56 RMSNorm + modulate sites. Not fused yet (issue 15): the QK
RMSNorms (``torch.nn.RMSNorm`` across heads) and LTX's own rotary embedding, the GELUs.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_ltx import LTXVideoTransformer3DModel, LTXVideoTransformerBlock

from .._state import PatchState, register_adapter
from ._chains import fused_subclass, swap_rewritten

# Created at import, so that a pickled patched model finds it here by name.
FastpathLTXVideoTransformerBlock, _BLOCK = fused_subclass(LTXVideoTransformerBlock, "FastpathLTXVideoTransformerBlock",
                                                          __name__)


@register_adapter(LTXVideoTransformer3DModel)
def patch_ltx(model: LTXVideoTransformer3DModel, state: PatchState) -> None:
    """Swap LTX-Video's blocks for their chain-fused subclass (see module doc)."""
    swap_rewritten(state, model, {LTXVideoTransformerBlock: (FastpathLTXVideoTransformerBlock, _BLOCK)})
