"""diffusers' ``RMSNorm`` modules that run alone get `FastpathRMSNorm`, whose forward is the fused, self-verified
`diffusers_fastpath.ops.rmsnorm`. A module swap, so any forward (diffusers' own or a rewritten one) reaches it by
calling the module as written.

- The QK norms of an attention (``norm_q``, ``norm_k``, ``norm_added_q``, ``norm_added_k``) whose output goes on
  unfused (no rotary embedding after it that a rewritten processor runs with the norm in one kernel), by the family
  adapters (`patch_qk_rmsnorms`): SD3 and SD3.5 (all four, head_dim 64), Lumina2 (``norm_q``, ``norm_k``, 96),
  HunyuanVideo and HunyuanImage-2.1 (all four, 128: their rotary takes a slice of the normalised q and k),
  HunyuanVideo-1.5's text stream (``norm_added_q``, ``norm_added_k``, 128). Norms that a family's rewritten processor
  fuses with the rotary after them (Qwen-Image's, Z-Image's, HunyuanVideo-1.5's image stream) stay diffusers' class.
- Every diffusers ``RMSNorm`` of a model the generic path patches (`patch_rmsnorms`): the pre-norms and QK norms no
  chain takes (Cosmos 3's), and those a fused chain does take, which then run as written only where that chain's op
  refuses (the chains' ops take both classes: `is_diffusers_rmsnorm`).
"""

from __future__ import annotations

from diffusers.models.normalization import RMSNorm

from .._state import PatchState, site_attr
from ..ops.rmsnorm import RMSNORM, rmsnorm
from ..ops.rmsnorm_scale_shift import RMSNORM_CLASSES

QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_SITE, _NAMED_SITE = site_attr(), site_attr(RMSNORM.name)


class FastpathRMSNorm(RMSNorm):
    """diffusers' ``RMSNorm``, alone: its forward is the fused, self-verified `rmsnorm` (diffusers' own forward
    wherever the guard refuses the input). Adds no state."""

    def forward(self, hidden_states):
        # its own site: the unnamed one, or a named one where a fused chain counts on the unnamed (LTX-2's norms)
        sites = self.__dict__
        return rmsnorm(self, hidden_states, sites.get(_NAMED_SITE) or sites.get(_SITE))


RMSNORM_CLASSES.add(FastpathRMSNorm)  # diffusers' numbers: the RMSNorm ops take it as they take diffusers' class


def is_diffusers_rmsnorm(norm) -> bool:
    """Whether `norm` computes diffusers' ``RMSNorm.forward``: that class, or `FastpathRMSNorm` (the same numbers,
    fused), not a subclass with a forward of its own."""
    return type(norm) is RMSNorm or type(norm) is FastpathRMSNorm


def _swap(norm: RMSNorm, state: PatchState) -> None:
    state.swap_class(norm, FastpathRMSNorm)
    state.add_site(norm, RMSNORM.name, RMSNORM.name if _SITE in norm.__dict__ else None)


def patch_rmsnorms(model, state: PatchState) -> int:
    """Swap every diffusers ``RMSNorm`` of `model` (that exact class, with a weight or without: LTX-2's weightless
    pre-norms) for `FastpathRMSNorm`, with its site; returns how many."""
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    for norm in norms:
        _swap(norm, state)
    return len(norms)


def patch_qk_rmsnorms(attn, state: PatchState, names: tuple[str, ...] = QK_NORMS) -> int:
    """Swap each of the attention module `attn`'s norms `names` that is diffusers' ``RMSNorm`` for `FastpathRMSNorm`,
    with its site; returns how many."""
    swapped = 0
    for name in names:
        norm = getattr(attn, name, None)
        if type(norm) is RMSNorm:
            _swap(norm, state)
            swapped += 1
    return swapped
