"""A block's closing residual update fused with the LayerNorm-modulate that reads the new stream next.

FLUX.1's blocks close a branch with ``x = residual + gate.unsqueeze(1) * update``, and the next thing that reads ``x``
is a LayerNorm-modulate: in the dual block, ``norm2`` (``norm2_context``) after the attention's update; at the end of a
block, the next block's adaLN (``norm1``, ``norm1_context``, a single block's ``norm``). Run apart, the update writes
``x`` and the LayerNorm reads it back; `gated_layernorm_scale_shift` does both in one kernel, which reads the residual
and the update and writes ``x`` and the modulated norm (two reads and two writes of the stream instead of five, and
one launch instead of two). 111 such pairs a FLUX.1-dev step.

Within a dual block (`gated_norm_modulate`) both halves are lines of one ``forward``. Across blocks the next block's
adaLN must have its modulation (``linear(silu(temb))``) before the previous block ends: `hand_off` computes it there,
from the same ``temb`` with the same module (so the same bits), runs the fused kernel, and leaves the modulation and
the normalised stream on the receiving adaLN module, which `take_hand_off` gives them to when it is called with that
very stream and embedding, unchanged since (same objects, same version counters); anything else (a ControlNet
residual added between the blocks, a hook's new tensors, a write in place) and the adaLN computes its LayerNorm as
written (its modulation still reused when ``temb`` is the same, unchanged tensor).

A hand-off is refused, and each block computes its own part as diffusers writes it, with the reason counted on the
receiver's ``gated`` site, where skipping the receiver's forward would skip more than its computation (hooks on the
receiving block, its adaLN or the adaLN's linear: accelerate's and diffusers' offloading move weights in them), where
autograd records (the order in which gradients of ``temb`` accumulate), for inference tensors (no version counter to
tell a write in place), for an adaLN with its own embedding, and for a float16 stream that diffusers clips between the
blocks. ``torch.compile`` traces take the plain path uncounted (the compiler fuses as it sees fit).
"""

from __future__ import annotations

import torch
from torch import nn

from .._state import PatchState, site_attr
from ..ops import gated_residual
from ..ops.layernorm_scale_shift import GATED_LAYERNORM_SCALE_SHIFT
from ..quality import hooked
from ._chain_calls import norm_modulate

GATED_MODULATE = "gated_layernorm_scale_shift"  # the op of every hand-off site
_SITE = site_attr("gated")  # a receiving norm's site for the fused update + LayerNorm-modulate (name "gated")
_PENDING = "_fastpath_hand_off"  # on a receiving adaLN: what the previous block computed for it
_SENDS = "_fastpath_hands_off_to"  # on a sending block: the receiving adaLNs of its streams (and their blocks)
REASON_CHANGED = "the stream changed after the hand-off (a ControlNet residual, a hook)"
REASON_FP16 = "float16 stream (diffusers clips it between the blocks)"


def add_receiver(state: PatchState, norm: nn.Module) -> None:
    """Give `norm` (a dual block's ``norm2``, or an adaLN that can be handed its input) its ``gated`` site."""
    state.add_site(norm, GATED_MODULATE, "gated")


def link(state: PatchState, sender: nn.Module, receivers: tuple) -> None:
    """Let `sender` hand off to `receivers`: ``(adaln, block)`` pairs, one per stream it closes (``None`` where that
    stream has none), each adaLN given its ``gated`` site and an empty hand-off slot (removed on unpatch)."""
    for pair in receivers:
        if pair is not None:
            add_receiver(state, pair[0])
            state.set_attr(pair[0], _PENDING, None)
    state.set_attr(sender, _SENDS, receivers)


def receivers_of(sender: nn.Module) -> tuple:
    return sender.__dict__.get(_SENDS) or ()


def _fused_update(norm: nn.LayerNorm, residual, gate, update, scale, shift, site, gate_site):
    """``(x, normed)``: ``x = residual + gate * update`` and ``normed = norm(x) * (1 + scale) + shift`` from one
    `gated_layernorm_scale_shift` kernel where the policy lets it run (counted on `site`, the update's fast call on
    `gate_site`); else ``(x, None)``, x from `gated_residual` (counted on `gate_site`) and the norm left to the caller.
    ``torch.compile`` traces take the latter, uncounted by this op."""
    out = None if torch.compiler.is_compiling() else GATED_LAYERNORM_SCALE_SHIFT.try_fast(
        site, norm, residual, gate, update, scale, shift)
    if out is None:
        return gated_residual(residual, gate, update, gate_site), None
    _count_fast(gate_site)
    return out


def gated_norm_modulate(norm: nn.LayerNorm, residual, gate, update, scale, shift, gate_site, norm_site):
    """``x = residual + gate * update`` and ``norm(x) * (1 + scale[:, None]) + shift[:, None]`` (a dual block's
    attention update and its ``norm2``): one `gated_layernorm_scale_shift` kernel, counted on `norm`'s ``gated`` site
    (then the update's and the norm's own sites count a fast call each), else the two fused ops as before. Returns
    ``(x, norm_x)``."""
    site = norm.__dict__[_SITE]  # `flux._link_blocks` gave every patched dual block's norm2s theirs
    x, normed = _fused_update(norm, residual, gate, update, scale, shift, site, gate_site)
    if normed is None:
        return x, norm_modulate(norm, x, scale, shift, norm_site)
    _count_fast(norm_site)
    return x, normed


def _count_fast(site) -> None:
    if site is not None:
        site.fast += 1


class _Pending:
    """What a sending block computed for the next block's adaLN: its modulation ``emb`` (``linear(silu(temb))``) and,
    where the fused kernel ran, ``normed``, the LayerNorm-modulate of ``x``; each valid for those very tensors at these
    versions."""

    __slots__ = ("x", "x_version", "temb", "temb_version", "emb", "normed")

    def __init__(self, x, temb, emb, normed) -> None:
        self.x, self.x_version, self.temb, self.temb_version = x, x._version, temb, temb._version
        self.emb, self.normed = emb, normed


def _refusal(adaln: nn.Module, block: nn.Module, tensors, clipped: bool) -> str | None:
    """Why `adaln` (of `block`) cannot be handed its input and modulation (module doc), or ``None``."""
    if getattr(adaln, "emb", None) is not None:
        return "adaLN with its own embedding"
    if hooked(block) or hooked(adaln) or hooked(adaln.linear) or hooked(adaln.norm):
        return "the receiving block has hooks"
    if clipped and tensors[0].dtype == torch.float16:
        return REASON_FP16
    if any(t.is_inference() for t in tensors):
        return "inference tensors (no version counter)"
    if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                    or any(p.requires_grad for p in adaln.linear.parameters())):
        return "requires grad"
    return None


def hand_off(receiver, residual, gate, update, temb, gate_site, clipped: bool = False, refused: str | None = None):
    """``residual + gate * update``, a block's closing update of one stream, counted on `gate_site`; and, where
    `receiver` (the ``(adaln, block)`` that reads the new stream next, or ``None``) can take it, the adaLN's
    modulation and LayerNorm-modulate computed now, the latter fused with the update, and left for `take_hand_off`
    (module doc). `clipped`: diffusers clips this stream in float16 before the next block reads it; `refused`: the
    sender's own reason not to (its stream changes after the update)."""
    if receiver is None or torch.compiler.is_compiling():
        return gated_residual(residual, gate, update, gate_site)
    adaln, block = receiver
    site = adaln.__dict__[_SITE]  # `link` gave every receiver its site
    reason = refused or _refusal(adaln, block, (residual, gate, update, temb), clipped)
    if reason is not None:
        adaln.__dict__[_PENDING] = None
        site.fallback[reason] += 1
        return gated_residual(residual, gate, update, gate_site)
    emb = adaln.linear(adaln.silu(temb))
    shift, scale = emb.chunk(adaln._fastpath_chunks, dim=1)[:2]
    # normed None: the adaLN computes its LayerNorm itself (its modulation is handed over all the same)
    x, normed = _fused_update(adaln.norm, residual, gate, update, scale, shift, site, gate_site)
    adaln.__dict__[_PENDING] = _Pending(x, temb, emb, normed)
    return x


def take_hand_off(adaln: nn.Module, x, temb):
    """What the previous block left for `adaln` called on ``x`` with ``temb``: ``(emb, normed)``, each ``None`` where
    it must be computed as written (nothing left; ``temb`` not the one it was computed from; ``normed`` also where
    ``x`` is not the stream it normalised). The slot is emptied either way."""
    pending = adaln.__dict__.get(_PENDING)
    if pending is None:
        return None, None
    adaln.__dict__[_PENDING] = None
    if pending.temb is not temb or temb._version != pending.temb_version:
        return None, None
    if pending.normed is not None and (pending.x is not x or x._version != pending.x_version):
        adaln.__dict__[_SITE].fallback[REASON_CHANGED] += 1
        return pending.emb, None
    return pending.emb, pending.normed
