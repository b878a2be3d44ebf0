"""Who calls the blocks: the check behind every value this package computes in one block and uses in a later one.

Two things are computed once and used later in the same forward: the hand-off of a stream's LayerNorm-modulate from
one block to the next (`_handoff`) and the values derived from the forward's rotary table that every layer reads
(`_rope_cache.derived`). Each is what eager computes at the later block only if the tensors it came from are
unchanged by then. A write that bumps a version counter is seen there; many writes do not bump one: through ``.data``,
through a tensor that shares the storage (``set_``, ``untyped_storage().copy_``, ``from_dlpack``, a NumPy view), in
place on an inference tensor. So the version counters are the second line; the first is who could write at all.

Code writes only a tensor it holds, and between two blocks of one forward the tensors the blocks hand each other are
held by: the transformer's forward (the loop that calls the blocks), the blocks and the modules they pass them to,
the hooks of all of those (module hooks, global hooks, a ``forward`` replaced on the instance: diffusers' and
accelerate's hooks), and whatever drives the blocks instead of the transformer's loop (a replaced transformer forward,
a cache library's loop, gradient checkpointing). A value is kept across blocks only where all of that is diffusers'
own code or this package's: the blocks called straight from the transformer's forward as diffusers defines it
(`model_forward`), and no hooks on what holds the tensors (each user checks what that is).

The later block checks that it runs inside that very call of the forward (`inside`, given the forward's `frame_key`):
by the frame's id and code, which nothing here keeps alive, and by a token the call holds in its locals. CPython gives
a new frame the id of a freed one, the next call of the model from the same line of a pipeline's loop very likely the
last call's; a value kept on a tensor that outlives the call (an input the pipeline hands to every step) or left
untaken when the call ended is for that call only.
"""

from __future__ import annotations

import inspect
import os
import weakref
from types import CodeType, FrameType

import diffusers
from torch import nn

from .._state import BOUND_SAFE_CODES, STATE_ATTR

_DIFFUSERS_DIR = os.path.dirname(os.path.abspath(diffusers.__file__)) + os.sep

# torch's frames between a caller and the module's forward: ``Module.__call__`` (``_wrapped_call_impl``),
# ``_call_impl``, and the ``inner`` that ``_call_impl`` runs forward in when there are hooks; by the code objects' ids
# (a frame runs these very objects; ``code in a_set`` hashes the code, 1 us a time in CPython 3.11, and the checks
# below walk several frames per block)
_MODULE_CALL = {id(c): c for c in (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__,
                                   *(c for c in nn.Module._call_impl.__code__.co_consts if isinstance(c, CodeType)))}

_OWN_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> (its forward, the code or None)


def own_forward_code(cls: type) -> CodeType | None:
    """The code of ``cls.forward`` (under decorators that keep ``__wrapped__``, as diffusers' ``apply_lora_scale``)
    where it is defined in the diffusers package; ``None`` where it is anything else (a subclass's own forward, a
    forward replaced on the class by another library)."""
    fn = getattr(cls, "forward", None)
    cached = _OWN_FORWARD.get(cls)
    if cached is not None and cached[0] is fn:
        return cached[1]
    try:
        code = inspect.unwrap(fn).__code__
    except (AttributeError, ValueError):
        code = None
    if code is not None and not os.path.abspath(code.co_filename).startswith(_DIFFUSERS_DIR):
        code = None
    _OWN_FORWARD[cls] = (fn, code)
    return code


def is_module_call(frame: FrameType | None) -> bool:
    """Whether `frame` is one of torch's frames of a module call (``Module.__call__`` and what it runs), by its code
    object's identity (a code equal to one of them but another object, as a reloaded torch would make, is no module
    call here: what is built on this then refuses, and the blocks compute as written)."""
    # (and a patched class's forward wrapper: `_state.bound_safe`, one code per class)
    if frame is None:
        return False
    code = frame.f_code
    key = id(code)
    return _MODULE_CALL.get(key) is code or BOUND_SAFE_CODES.get(key) is code


def module_caller(frame: FrameType | None) -> FrameType | None:
    """The frame that called, through ``Module.__call__``, the module whose ``forward`` runs in `frame`; ``None``
    where that forward was called otherwise (a wrapper replacing ``forward`` on the instance, a direct
    ``.forward(...)``, ``torch.utils.checkpoint``)."""
    caller = frame.f_back if frame is not None else None
    if not is_module_call(caller):
        return None
    while is_module_call(caller):
        caller = caller.f_back
    return caller


def model_forward(frame: FrameType | None) -> FrameType | None:
    """`frame` itself if it runs the forward of a patched model as diffusers defines it (`own_forward_code` of its
    class), else ``None``."""
    if frame is None:
        return None
    model = frame.f_locals.get("self")
    if not isinstance(model, nn.Module) or STATE_ATTR not in vars(model):
        return None
    return frame if frame.f_code is own_forward_code(type(model)) else None


def enclosing_model_forward(frame: FrameType | None, limit: int = 64) -> FrameType | None:
    """The frame of the patched model's own forward (`model_forward`) that `frame` runs inside, through module calls
    only at its end: the frame just below it must be a module call (a block called by the model's loop), else
    ``None``. Looked for among the callers of the first `limit` frames."""
    below = None
    while frame is not None and limit > 0:
        if below is not None and is_module_call(below) and not is_module_call(frame):
            if model_forward(frame) is not None:
                return frame
        below, frame, limit = frame, frame.f_back, limit - 1
    return None


class _Call:
    """One call of a function, planted in its frame's locals by `frame_key` (under `_CALL`): a new object per call,
    and every key that names the call holds it, so no later call's is it (where the frame's id is the next call's
    once the frame is freed)."""

    __slots__ = ()


# the key of a call's `_Call` in its frame's locals: no local variable can have it (not an identifier), so the
# function's own names and values are as they were; CPython keeps a key that is no local of the frame in its locals
# mapping for the frame's life (3.11 and 3.12: the dict cached on the frame, which ``f_locals`` refreshes only for
# the function's own names; 3.13: the frame's extra locals, which its ``f_locals`` proxy reads and writes)
_CALL = "<diffusers_fastpath: this call>"


def inside(frame: FrameType | None, forward: tuple[int, CodeType, _Call], limit: int = 64) -> bool:
    """Whether `frame` runs inside the call of a function that `forward` names (`frame_key`: the frame's id, its
    code and that call's token; held so, nothing here keeps a finished forward's locals alive), an ancestor within
    `limit` frames, through a module call that forward made itself (the frame just below it is a module call). A
    frame of that id and code that holds another token (or none) is a later call in a reused frame id, not it."""
    below = None
    while frame is not None and limit > 0:
        if id(frame) == forward[0] and frame.f_code is forward[1]:
            return below is not None and is_module_call(below) and frame.f_locals.get(_CALL) is forward[2]
        below, frame, limit = frame, frame.f_back, limit - 1
    return False


def frame_key(frame: FrameType) -> tuple[int, CodeType, _Call]:
    """What `inside` takes for `frame`, a running frame: its id, its code and the token of this call (planted in its
    locals at the first ask in the call, the same at every later one). CPython reuses a freed frame's id, for the
    next call of the same function from the same line too (a pipeline's loop calling the model once a step): the
    token, not the id, tells one call from the next."""
    mapping = frame.f_locals
    token = mapping.get(_CALL)
    if type(token) is not _Call:
        token = mapping[_CALL] = _Call()
    return id(frame), frame.f_code, token
