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

What runs between the sending block's update and the receiving adaLN (a write there that bumps no version counter,
``.data`` or a NumPy view or in place on an inference tensor, would leave the handed-over values stale; `_driver`):
the rest of the sending block's forward (this package's; for the dual block's image stream also its text stream's
``norm2_context`` and ``ff_context`` and the text receiver's early modulation), the sending block's hooks, the
transformer's loop between the two calls (diffusers' own: its ControlNet residual is added out of place), the
receiving block's pre-hooks and its forward up to its adaLNs (this package's), and the adaLNs' hooks. So the sender
hands off only where the blocks are called straight from the transformer's own diffusers forward, one after the
other in its block list (not by a replaced forward, a wrapper, checkpointing or a cache library's loop: cache-dit's,
which skips blocks, would leave hand-offs no block takes), and nothing there has hooks (`quality.hooked`: module
hooks, global hooks, a replaced ``forward``). The receiving adaLN takes what it finds only in the same call of
the forward (not a later one that CPython runs in a frame of the same id: `_driver.frame_key`), for the same tensors
at the same versions (the second line); a hand-off never taken is counted as wasted.

A hand-off is also refused, and each block computes its own part as diffusers writes it, with the reason counted on
the receiver's ``gated`` site, where autograd records (the order in which gradients of ``temb`` accumulate), where a
module it runs early is in training mode (a LoRA layer's dropout would draw its random numbers in another order), for
an adaLN with its own embedding, and for a float16 stream that diffusers clips between the blocks. ``torch.compile``
traces take the plain path uncounted (the compiler fuses as it sees fit).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .._state import PatchState, site_attr
from ..ops import gated_residual
from ..ops.layernorm_scale_shift import GATED_LAYERNORM_SCALE_SHIFT
from ..ops._policy import hooks_on
from ..quality import hooked
from ._chain_calls import norm_modulate
from ._driver import frame_key, inside, model_forward, module_caller

GATED_MODULATE = "gated_layernorm_scale_shift"  # the op of every hand-off site
_SITE = site_attr("gated")  # a receiving norm's site for the fused update + LayerNorm-modulate (name "gated")
_PENDING = "_fastpath_hand_off"  # on a receiving adaLN: what the previous block computed for it
_SENDS = "_fastpath_hands_off_to"  # on a sending block: (receivers, its block list's attribute, its index there)
REASON_CHANGED = "the stream changed after the hand-off (a ControlNet residual, a hook)"
REASON_FP16 = "float16 stream (diffusers clips it between the blocks)"
REASON_HOOKS = "hooks on the sending or receiving block, the adaLN or a module that runs between"
REASON_DRIVER = ("the blocks are not called one after the other by diffusers' own forward (a replaced forward, a "
                 "wrapper, checkpointing, a cache library)")
REASON_TRAINING = "training mode (a module run early could draw random numbers, as dropout does)"
REASON_WASTED = "handed off, never taken (the receiving block did not run next)"
_OWN = __name__.rsplit(".", 1)[0] + "."  # this package's models: the receiving block's forward is one of them


def add_receiver(state: PatchState, norm: nn.Module) -> None:
    """Give `norm` (a dual block's ``norm2``, or an adaLN that can be handed its input) its ``gated`` site."""
    state.add_site(norm, GATED_MODULATE, "gated")


def link(state: PatchState, sender: nn.Module, receivers: tuple, blocks: str, index: int) -> None:
    """Let `sender`, ``model.<blocks>[index]``, hand off to `receivers`: ``(adaln, block)`` pairs, one per stream it
    closes (``None`` where that stream has none), ``block`` the next of that list; each adaLN gets its ``gated``
    site and an empty hand-off slot (removed on unpatch)."""
    for pair in receivers:
        if pair is not None:
            add_receiver(state, pair[0])
            state.set_attr(pair[0], _PENDING, None)
    state.set_attr(sender, _SENDS, (receivers, blocks, index))


def receivers_of(sender: nn.Module) -> tuple:
    link_ = sender.__dict__.get(_SENDS)
    return link_[0] if link_ else ()


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
    versions (``None`` for an inference tensor, which has no version counter), in the call of the forward that
    `driver` names (`_driver.frame_key`)."""

    __slots__ = ("x", "x_version", "temb", "temb_version", "emb", "normed", "driver")

    def __init__(self, x, temb, emb, normed, driver) -> None:
        self.x, self.x_version, self.temb, self.temb_version = x, _version(x), temb, _version(temb)
        self.emb, self.normed, self.driver = emb, normed, driver


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _hooked_tree(module: nn.Module, stands_for=hooked) -> bool:
    return any(stands_for(m) for m in module.modules())


def _refusal(sender: nn.Module, adaln: nn.Module, block: nn.Module, tensors, clipped: bool, between, frame):
    """``(reason, None)``: why `adaln` (of `block`) cannot be handed its input and modulation by `sender`, whose
    forward runs in `frame` and runs `between` after this hand-off (module doc); or ``(None, driver)``, the frame of
    the transformer's forward that calls both blocks."""
    if getattr(adaln, "emb", None) is not None:
        return "adaLN with its own embedding", None
    if clipped and tensors[0].dtype == torch.float16:
        return REASON_FP16, None
    if torch.is_grad_enabled() and (any(t.requires_grad for t in tensors)
                                    or any(p.requires_grad for p in adaln.linear.parameters())):
        return "requires grad", None
    if any(m.training for m in adaln.modules()):
        return REASON_TRAINING, None
    if (hooked(sender) or hooked(block) or any(_hooked_tree(pair[0]) for pair in receivers_of(sender) if pair)
            or any(_hooked_tree(m, hooks_on) for m in between)):  # (called as they are: their hooks alone)
        return REASON_HOOKS, None
    driver = model_forward(module_caller(frame))
    if driver is None or not type(block).forward.__module__.startswith(_OWN):  # the receiver's forward replaced
        return REASON_DRIVER, None
    _, attr, index = sender.__dict__[_SENDS]
    blocks = getattr(driver.f_locals["self"], attr, None)
    if not (isinstance(blocks, nn.ModuleList) and index + 1 < len(blocks) and blocks[index] is sender
            and blocks[index + 1] is block):
        return REASON_DRIVER, None
    return None, driver


def hand_off(sender, receiver, residual, gate, update, temb, gate_site, clipped: bool = False,
             refused: str | None = None, between: tuple = ()):
    """``residual + gate * update``, a block's closing update of one stream, counted on `gate_site`; and, where
    `receiver` (the ``(adaln, block)`` that reads the new stream next, or ``None``) can take it, the adaLN's
    modulation and LayerNorm-modulate computed now, the latter fused with the update, and left for `take_hand_off`
    (module doc). Called by `sender`'s forward itself. `clipped`: diffusers clips this stream in float16 before the
    next block reads it; `refused`: the sender's own reason not to (its stream changes after the update);
    `between`: the sender's modules that run after this update."""
    if receiver is None or torch.compiler.is_compiling():
        return gated_residual(residual, gate, update, gate_site)
    adaln, block = receiver
    site = adaln.__dict__[_SITE]  # `link` gave every receiver its site
    if adaln.__dict__.get(_PENDING) is not None:  # an earlier hand-off nobody took
        site.fallback[REASON_WASTED] += 1
    reason, driver = (refused, None) if refused else _refusal(
        sender, adaln, block, (residual, gate, update, temb), clipped, between, sys._getframe(1))
    if reason is not None:
        adaln.__dict__[_PENDING] = None
        site.fallback[reason] += 1
        return gated_residual(residual, gate, update, gate_site)
    emb = adaln.linear(adaln.silu(temb))
    shift, scale = emb.chunk(adaln._fastpath_chunks, dim=1)[:2]
    # normed None: the adaLN computes its LayerNorm itself (its modulation is handed over all the same)
    x, normed = _fused_update(adaln.norm, residual, gate, update, scale, shift, site, gate_site)
    adaln.__dict__[_PENDING] = _Pending(x, temb, emb, normed, frame_key(driver))
    return x


def take_hand_off(adaln: nn.Module, x, temb, frame):
    """What the previous block left for `adaln`, whose forward runs in `frame`, called on ``x`` with ``temb``:
    ``(emb, normed)``, each ``None`` where it must be computed as written (nothing left; left in another forward or
    for another ``temb``, or for one written since: counted as wasted; ``normed`` also where ``x`` is not the stream
    it normalised, or was written since). The slot is emptied either way."""
    pending = adaln.__dict__.get(_PENDING)
    if pending is None:
        return None, None
    adaln.__dict__[_PENDING] = None
    if (not inside(frame, pending.driver) or pending.temb is not temb
            or _version(temb) != pending.temb_version):
        adaln.__dict__[_SITE].fallback[REASON_WASTED] += 1
        return None, None
    if pending.normed is not None and (pending.x is not x or _version(x) != pending.x_version):
        adaln.__dict__[_SITE].fallback[REASON_CHANGED] += 1
        return pending.emb, None
    return pending.emb, pending.normed
