"""What a model family registers so that `graphs` can capture its forward, and the recording thread's state.

- Capture twins (`register_capture_twin`, `CAPTURE_TWINS`): a module-level function the forward calls by its global
  name, bound to a twin that waits on nothing while the forward records (`capture_twins_bound`).
- Host keys (`register_host_key`, `HOST_KEYS`): the input values a forward reads on the host, which join its graph's
  signature, and the side data its twins read instead while it records (`capture_side`).
- Host ops (`register_host_ops`, `HOST_OPS`): the data-dependent calls of a forward answered from its warm-up
  (`_host_ops`).
- Each registration stands for the forward it was made for (`HOST_FORWARDS`, `registered`).
- Whether, and with what side data, a forward records on this thread (`recording`, `capture_side`, `_side_bound`):
  set by `graphs.GraphRunner._record` around the warm-up and the capture.

Split out of `graphs`, which re-exports every name here but `_recording`; the model families call them as
``graphs.<name>``. The tables are mutated in place, never rebound, so either name reaches the same dict.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

from torch import nn


# Module-level functions that a model's forward calls by their global name and that cannot run inside a capture as
# written (a host-to-device copy of a Python number, say), by the model class whose forward calls them:
# ``[(module, name, original, twin)]``. While a forward of such a model records (warm-up and capture, `_record`),
# ``module.name`` is bound to `twin` (same results, nothing that waits on the host) and put back after; the first
# replay is compared with the eager forward as always. Outside a recording the name is diffusers' own function.
CAPTURE_TWINS: dict[type, list[tuple[Any, str, Callable, Callable]]] = {}


def register_capture_twin(model_cls: type, module: Any, name: str, twin: Callable) -> None:
    """Record `twin` as what ``module.name`` (as installed now) is bound to while a `model_cls` forward records."""
    CAPTURE_TWINS.setdefault(model_cls, []).append((module, name, getattr(module, name), twin))


# What a model's forward reads from its inputs on the host and bakes into the graph (shapes and loop bounds that follow
# from tensor values: Lumina2's caption lengths), by model class: ``fn(model, call) -> (key, side)`` with ``call`` the
# forward's arguments by name. It runs before every call, outside any capture (where it may wait on the GPU: eager
# waits there too); ``key`` joins the call's signature, so that a graph recorded for some values is never replayed
# for others, and ``side()`` (called at most once, while that signature records) gives what the model's capture twins
# read instead of waiting on the host (`capture_side`). ``key`` None: the call runs eager.
HOST_KEYS: dict[type, Callable[[nn.Module, dict], tuple[Any, Callable[[], Any]]]] = {}
# The forward a registration of `HOST_KEYS` / `HOST_OPS` was made for, by model class: ``model_cls.forward`` as
# `register_host_key` found it (the forward whose host reads its caller checked: a source read, a digest). A
# registration applies to a model whose class runs that very forward (`registered`): its class, or a subclass that
# does not override ``forward``; not to a subclass with a forward of its own, nor after the class's forward was
# replaced (a forward whose host reads nobody checked: no key, its recording runs as any model's).
HOST_FORWARDS: dict[type, Callable] = {}
_recording = threading.local()


def register_host_key(model_cls: type, fn: Callable[[nn.Module, dict], tuple[Any, Callable[[], Any]]]) -> None:
    """Record `fn` as the host key of `model_cls` forwards (see `HOST_KEYS`), for the forward the class holds now
    (`HOST_FORWARDS`)."""
    HOST_KEYS[model_cls] = fn
    HOST_FORWARDS[model_cls] = model_cls.forward


def registered(table: dict[type, Any], model: nn.Module) -> Any:
    """`model`'s entry of `table` (`HOST_KEYS`, `HOST_OPS`), or None: the entry of the nearest class of its MRO that
    has one, where that registration was made for the forward the model's class runs (`HOST_FORWARDS`); a subclass
    that overrides ``forward`` inherits none."""
    forward = type(model).forward
    for cls in type(model).__mro__:
        entry = table.get(cls)
        if entry is not None:
            return entry if HOST_FORWARDS.get(cls) is forward else None
    return None


# Model classes whose forward's data-dependent calls (``nonzero``, boolean indexing, ``repeat_interleave`` by a tensor,
# host reads, index tables from Python lists) are recorded in the warm-up and answered in the capture
# (`_host_ops`): only for a forward whose host key holds every input value those calls depend on (Qwen-Image 2.1's
# image-slot mask), so that the answers are the same for every call a graph replays for.
# By model class: the source files (by name) whose calls are answered, `_host_ops.replayed`'s ``files``.
HOST_OPS: dict[type, tuple[str, ...]] = {}


def register_host_ops(model_cls: type, files: tuple[str, ...]) -> None:
    """Answer the data-dependent calls that the code of `files` makes in `model_cls` forwards from their warm-up while
    one records (`HOST_OPS`)."""
    if model_cls not in HOST_KEYS:
        raise ValueError(f"{model_cls.__name__}: a host key (register_host_key) must hold what its host ops read")
    if HOST_FORWARDS.get(model_cls) is not model_cls.forward:
        raise ValueError(f"{model_cls.__name__}: its host key was registered for another forward")
    HOST_OPS[model_cls] = tuple(files)


def recording() -> bool:
    """Whether a forward records on this thread now (its warm-up or its capture: `GraphRunner._record`)."""
    return getattr(_recording, "active", False)


def capture_side() -> Any:
    """While a forward records, the side data of its host key (`HOST_KEYS`), else None."""
    side = getattr(_recording, "side", None)
    if side is None:
        return None
    if not hasattr(_recording, "value"):
        _recording.value = side()
    return _recording.value


@contextlib.contextmanager
def _side_bound(side: Callable[[], Any] | None):
    _recording.side, _recording.active = side, True
    try:
        yield
    finally:
        _recording.side, _recording.active = None, False
        if hasattr(_recording, "value"):
            del _recording.value


@contextlib.contextmanager
def capture_twins_bound(model_cls: type):
    """Bind the capture twins of `model_cls` (and its bases) for the duration; a name that something else has
    rebound since its registration is left alone."""
    bound = []
    for cls, twins in CAPTURE_TWINS.items():
        for module, name, original, twin in twins if issubclass(model_cls, cls) else ():
            if getattr(module, name) is original:
                own = name in vars(module)  # (else inherited, as torch.Tensor's C methods: deleted again after)
                setattr(module, name, twin)
                bound.append((module, name, original, own))
    try:
        yield
    finally:
        for module, name, original, own in reversed(bound):
            if own:
                setattr(module, name, original)
            else:
                delattr(module, name)
