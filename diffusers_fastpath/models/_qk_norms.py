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
- Every zero-centred float32 RMSNorm of such a model (a class whose ``forward`` is, by source digest, Krea 2's
  ``F.rms_norm(x.float(), (dim,), weight=self.weight + 1.0, eps=self.eps).to(x.dtype)``:
  `_chain_qk_fp32.is_zero_centred`), by `patch_zero_centred_norms`: a subclass of its class whose forward is the fused,
  self-verified `diffusers_fastpath.ops.zero_centred_rmsnorm` (`zero_centred_class`, one per class, found by name
  in any process so that pickles load). The QK norms among them still go to their chain's fused norm + rotary.
"""

from __future__ import annotations

import base64

from diffusers.models.normalization import RMSNorm

from .._source import named_object
from .._state import PatchState, site_attr
from ..ops.rmsnorm import RMSNORM, rmsnorm
from ..ops.rmsnorm_scale_shift import RMSNORM_CLASSES
from ..ops.zero_centred_rmsnorm import ZERO_CENTRED_RMSNORM, add_norm_class, zero_centred_rmsnorm
from ._chain_qk_fp32 import EAGER_CLASS_ATTR, is_zero_centred

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


# --- zero-centred float32 RMSNorms (Krea 2's Krea2RMSNorm) --------------------------------------------------------
_ZC_PREFIX = "FastpathZeroCentred_"  # + the base class's "module:qualname" in base32: `__getattr__` makes it again


def _zero_centred_forward(self, hidden_states):
    """The norm's forward: the fused, self-verified `zero_centred_rmsnorm` (its class's own forward where the guard
    refuses the input)."""
    return zero_centred_rmsnorm(self, hidden_states, self.__dict__.get(_SITE))


def zero_centred_class(base: type) -> type:
    """This package's subclass of `base` (a class whose forward `is_zero_centred` proved Krea 2's zero-centred norm):
    no state of its own, its forward the fused norm; one object per base class, named for pickles."""
    name = _ZC_PREFIX + base64.b32encode(f"{base.__module__}:{base.__qualname__}".encode()).decode().rstrip("=")
    sub = globals().get(name)
    if sub is None or sub.__bases__ != (base,):
        sub = type(name, (base,), {"forward": _zero_centred_forward, "__module__": __name__, "__qualname__": name,
                                   EAGER_CLASS_ATTR: base, "__doc__": f"{base.__name__}, its forward fused."})
        sub.__name__ = f"Fastpath{base.__name__}"  # what messages and `report` show; pickles go by the qualified name
        globals()[name] = sub
        add_norm_class(sub, base)
    return sub


def patch_zero_centred_norms(model, state: PatchState) -> int:
    """Swap every zero-centred float32 RMSNorm of `model` (`is_zero_centred`) for `zero_centred_class` of its class,
    with its site; returns how many."""
    norms = [m for m in model.modules() if EAGER_CLASS_ATTR not in type(m).__dict__ and is_zero_centred(m)]
    for norm in norms:
        state.swap_class(norm, zero_centred_class(type(norm)))
        state.add_site(norm, ZERO_CENTRED_RMSNORM.name)
    return len(norms)


def __getattr__(name: str):
    """A pickled patched model's norm class in a fresh process (PEP 562): made again from its name."""
    if not name.startswith(_ZC_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    encoded = name[len(_ZC_PREFIX):]
    module, qualname = base64.b32decode(encoded + "=" * (-len(encoded) % 8)).decode().split(":")
    return zero_centred_class(named_object(module, qualname))
