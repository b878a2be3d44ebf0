"""The QK norms that run alone: diffusers' ``RMSNorm`` modules of an attention (``norm_q``, ``norm_k``,
``norm_added_q``, ``norm_added_k``) whose output goes on unfused (no rotary embedding after it that a rewritten
processor runs with the norm in one kernel) get `FastpathRMSNorm`, whose forward is the fused, self-verified
`diffusers_fastpath.ops.rmsnorm`. A shared module swap, so any family's processor (diffusers' own or a rewritten one)
reaches it by calling the module as written: SD3 and SD3.5 (all four, head_dim 64), Lumina2 (``norm_q``,
``norm_k``, 96), HunyuanVideo and HunyuanImage-2.1 (all four, 128: their rotary takes a slice of the normalised
q and k), HunyuanVideo-1.5's text stream (``norm_added_q``, ``norm_added_k``, 128).

Norms that a rewritten processor fuses with the rotary after them (Qwen-Image's, Z-Image's, HunyuanVideo-1.5's image
stream) stay diffusers' class: the processors recognise them by exact type.
"""

from __future__ import annotations

from diffusers.models.normalization import RMSNorm

from .._state import PatchState
from ..ops.rmsnorm import RMSNORM, rmsnorm

QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class FastpathRMSNorm(RMSNorm):
    """diffusers' ``RMSNorm`` as a QK norm: its forward is the fused, self-verified `rmsnorm` (diffusers' own forward
    wherever the guard refuses the input). Adds no state."""

    def forward(self, hidden_states):
        return rmsnorm(self, hidden_states, self._fastpath_site)


def patch_qk_rmsnorms(attn, state: PatchState, names: tuple[str, ...] = QK_NORMS) -> int:
    """Swap each of the attention module `attn`'s norms `names` that is diffusers' ``RMSNorm`` for `FastpathRMSNorm`,
    with its site; returns how many."""
    swapped = 0
    for name in names:
        norm = getattr(attn, name, None)
        if type(norm) is RMSNorm:
            state.swap_class(norm, FastpathRMSNorm)
            state.add_site(norm, RMSNORM.name)
            swapped += 1
    return swapped
