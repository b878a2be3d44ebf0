"""CUDA graphs for the lossless path: ``patch(pipe, cuda_graphs=True)``.

Eager PyTorch spends host time enqueueing every kernel of a step (FLUX.1-dev on an H200: 105 ms of host time
against 171 ms of GPU work at 1024x1024, 48.5 ms against 58.2 ms at 512x512), so once fusion cuts GPU time the
host becomes the limit. A captured CUDA graph replays the very same kernels in the same order with one launch,
so its output is bit-identical to the eager forward it was captured from (unlike ``torch.compile``'s
"reduce-overhead", which also changes the kernels).

How it works, per patched model (`GraphRunner`):

- The transformer's ``forward`` is replaced per instance (an attribute in the model's ``__dict__``, recorded in
  the `PatchState` undo log, so `unpatch` restores it and drops every graph, buffer and the pool).
- Each call is reduced to a *signature*: per argument, tensors by shape, stride, dtype and device, ``None`` and
  plain values (``return_dict``, ...) by value, lists and tuples element by element; plus the global settings
  that choose kernels (inference mode, autocast, SDPA backends, matmul precision, diffusers' attention backend).
  A non-empty dict (``joint_attention_kwargs``) or an unknown object runs eager, with the reason counted.
- The first call of a signature runs eager (that result is returned), then the forward is warmed up on a side
  stream and captured into static input buffers with every graph of the model sharing one memory pool, replayed
  once and compared with the eager result by ``torch.equal``. A mismatch disables graphs for the model for good
  (one warning); a capture that fails (something in the forward syncs the host) leaves that signature eager
  (one warning per model).
- Later calls copy the inputs into the static buffers, replay, and return a clone of the outputs: the static
  outputs are overwritten by the next replay (and the pool is shared by all graphs of the model), so handing
  them out would alias; the clone is latents-sized, a few microseconds.
- Nothing is cached from one forward to the next (the rotary tables are built once per forward, as diffusers
  builds them): the graph rebuilds cos/sin from the static position-id buffers on every replay (a handful of
  small kernels), so a replay can never use a table built from other ids; nor a value derived from an input and
  kept on it (`_rope_cache.derived`, sealed for one call of the forward): the static inputs forget such values
  before the warm-up and before the capture (`_run_fresh`), so the graph computes them. A small tensor the forward
  builds from Python values on the GPU (``torch.tensor(self.scale_factors, device=...)``, LTX-2's rotary
  coordinates: a pageable copy, which a capture refuses) is built inside the capture by fill kernels of those values
  (`_host_constants`), baked in as every Python number a kernel takes is. A forward that reads its inputs' values on
  the host keys its graphs on them (`register_host_key`) and, while it records, has its reads answered from the key
  (`_host_reads`: Bria FIBO 2's ``.tolist()``) or its data-dependent calls answered from the warm-up (`_host_ops`:
  Qwen-Image 2.1's ``nonzero``, boolean indexing, ``repeat_interleave`` by a tensor; `register_host_ops`).
- The graphs stand for the forward they were installed on. A library that replaces or wraps ``model.forward`` on
  the instance after `patch` (cache-dit's ``enable_cache``, accelerate's and diffusers' hooks, any
  ``model.forward = wrapper(model.forward)``) keeps per-call state that a recording would advance and a replay would
  skip: cache-dit 1.5.3 counts calls to pick its step and CFG branch, so the warm-up, the capture and the checking
  replay were three extra steps on Wan (other latents than cache-dit alone) and, on Qwen-Image (true CFG, two text
  lengths), made the next call read the other branch's cached residual (a size mismatch); on FLUX its own forward
  replaced ours, so nothing was captured while `report` said "on". So while the model's ``forward`` is not this
  package's, each call that still reaches us runs the class's forward once, eager, with the reason counted, and
  `report` says "paused" and by what (`GraphRunner.replaced`); once the library puts our forward back
  (``disable_cache``), graphs resume. A forward already replaced when `patch` runs keeps graphs off for that patch,
  with the reason (`install`).
- Before each replay a `ModelFingerprint` is re-checked: module classes, instance attributes, hooks, the
  identity of every parameter, buffer, submodule and attention processor, and each weight's data pointer. Any
  change (``.to()``, ``load_state_dict(assign=True)``, a LoRA layer injected, a hook or processor set) drops the
  model's graphs, which are re-captured on demand. In-place writes to weights (``load_state_dict`` without
  ``assign``, ``fuse_lora``) need nothing: a replay reads the weights' memory, as eager does.

Where the pieces are: this module holds the runner (`GraphRunner`, `GraphForward`, `install`), the call signature
(`call_signature`, `_host_key`) and the CUDA side (`CudaGraphs`, `_Graph`, `_run_fresh`). What a model family
registers to make its forward capturable (capture twins, host keys, host ops) and the recording thread's state are in
`_graph_registry`; what a graph stands for besides its inputs (`ModelFingerprint`, `_global_state`) in
`_graph_fingerprint`. Their public names (and the private ones tests use: `_global_state`, `_side_bound`) are
re-exported here, so ``graphs.<name>`` reaches what it did before the split (a re-export is a second binding:
to replace one of those functions, as a test may, set it in its own module).
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import traceback
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import _host_ops
from ._graph_fingerprint import _LEAF_TYPES, ModelFingerprint, _global_state
from ._graph_registry import (  # noqa: F401  (the registry's names stay reachable as graphs.<name>)
    CAPTURE_TWINS,
    HOST_FORWARDS,
    HOST_KEYS,
    HOST_OPS,
    _side_bound,
    capture_side,
    capture_twins_bound,
    recording,
    register_capture_twin,
    register_host_key,
    register_host_ops,
    registered,
)
from ._host_constants import constants_as_fills
from ._logging import logger, warn_once
from .ops._policy import global_module_hooks, outputs_equal

GRAPHS_ATTR = "_fastpath_graphs"
MAX_SIGNATURES = 8  # per model; a pipeline needs one or two (CFG, two text lengths), resolutions add one each

REASON_NO_CUDA = "CUDA is not available"
REASON_GRAD = "autograd is enabled (call under torch.no_grad() or torch.inference_mode())"
REASON_TRAINING = "the model is in training mode"
REASON_GLOBAL_HOOKS = "global module forward hooks are registered (a replay would skip them)"
REASON_TOO_MANY = f"more than {MAX_SIGNATURES} input signatures"
REASON_DISABLED = "CUDA graphs disabled for this model"
# A forward replaced per instance by a library (see the module doc): after patch (graphs pause) or before (graphs off)
REASON_REPLACED = ("model.forward was replaced per instance after patch, by {who}: recording would run it again and a "
                   "replay would skip it")
REASON_WRAPPED_BEFORE = ("model.forward is already replaced per instance, by {who}: recording would run it again and a "
                         "replay would skip it")


def _host_key(model: nn.Module, names: tuple[str, ...], args: tuple, kwargs: dict):
    """``(key, side)`` of the model's host key, or None where its class has none; `Unsupported` where it says so."""
    fn = registered(HOST_KEYS, model)
    if fn is None:
        return None
    key, side = fn(model, dict(zip(names, args), **kwargs))
    if key is None:
        raise Unsupported(f"{type(model).__name__}: its host-read inputs are not what a graph can key on")
    return key, side


def _raised_at(exc: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION)``: the innermost frame of `exc`'s traceback outside torch (the model's or this
    package's line that did what capture forbids: a host copy, a sync), or ``""``."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path:
            return f" (at {path.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name})"
    return ""


class Unsupported(Exception):
    """A call that a graph cannot stand for; the message is the reason counted in `report`."""


def _leaf_signature(name: str, value: Any, device: torch.device, tensors: list) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise Unsupported(f"input {name} is on {value.device}, the model on {device}")
        if value.layout is not torch.strided:
            raise Unsupported(f"input {name} has layout {value.layout}")
        tensors.append(value)
        return (value.shape, value.stride(), value.dtype)
    if isinstance(value, _LEAF_TYPES):
        return (type(value), value)  # the type too: 1 == 1.0 == True, but they are different constants
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_leaf_signature(name, v, device, tensors) for v in value))
    if isinstance(value, dict):
        if value:
            raise Unsupported(f"unsupported kwargs: {name} with keys {sorted(map(str, value))}")
        return (dict,)
    raise Unsupported(f"unsupported argument {name} of type {type(value).__name__}")


def call_signature(names: tuple[str, ...], args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, list]:
    """The signature of ``forward(*args, **kwargs)`` and its tensors in order, or `Unsupported` with the reason.

    Arguments are matched to ``names`` (the forward's parameters), so passing one by position or by keyword gives
    the same signature; an absent argument is absent from it (the forward's default applies in both cases).
    """
    if len(args) > len(names):
        raise Unsupported("more positional arguments than the forward takes")
    call = dict(zip(names, args))
    for name, value in kwargs.items():
        if name in call or name not in names:
            raise Unsupported(f"unexpected argument {name}")
        call[name] = value
    tensors: list[torch.Tensor] = []
    sig = tuple((name, _leaf_signature(name, call[name], device, tensors)) for name in names if name in call)
    return sig, tensors


def _substitute(value: Any, tensors) -> Any:
    """`value` with each tensor replaced by the next of the iterator `tensors` (same order as `call_signature`)."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, tensors) for v in value)
    return value



def _callable_name(fn: Any) -> str:
    """``module.qualname`` of what a library put in a model's ``forward`` (through ``functools.partial`` and bound
    methods: accelerate's, diffusers' and cache-dit's wrappers are partials of a local function)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


def _is_class_forward(model: nn.Module, fn: Any) -> bool:
    """Whether `fn` is the model's class forward bound to the model: what nn.Module calls anyway (cache-dit's
    ``disable_cache`` leaves one in the instance dict)."""
    return getattr(fn, "__self__", None) is model and getattr(fn, "__func__", None) is type(model).forward



class CudaGraphs:
    """The CUDA side of a `GraphRunner`: a memory pool (with its capture stream), capture, pool size."""

    device_type = "cuda"

    def new_pool(self, device: torch.device) -> tuple:
        with torch.cuda.device(device):
            return (device, torch.cuda.graph_pool_handle(), torch.cuda.Stream())

    def record(self, pool: tuple, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Warm ``fn`` up on the pool's capture stream, then capture it into a graph whose memory is the pool's."""
        device, handle, stream = pool
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            # Warm up on the capture stream first (lazy per-stream state), as torch's capture recipe does.
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # return the warm-up's blocks (cached for the side stream), as torch.cuda.graph does
            graph = torch.cuda.CUDAGraph()
            # A capture registers the device's default generator and puts its state in capture mode until
            # capture_end; an invalidated capture's capture_end raises before it puts the state back, and every
            # later random op on the device would fail. Keep a copy to reinstate if the capture fails.
            generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
            saved = generator.clone_state() if hasattr(generator, "clone_state") else None
            with torch.cuda.stream(stream), constants_as_fills():  # (small torch.tensor(values, device=cuda) calls)
                graph.capture_begin(handle)
                try:
                    out = fn()
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture is invalid anyway; the forward's error is the cause
                        if saved is not None:
                            generator.graphsafe_set_state(saved)
                    raise
                graph.capture_end()
            current.wait_stream(stream)
        return graph, out

    def pool_bytes(self, pool: tuple) -> int:
        handle = tuple(pool[1])
        try:
            return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == handle)
        except Exception:  # noqa: BLE001 - a report detail; never fail a call over it
            return 0


def _run_fresh(forward: Callable, call: dict, static: list[torch.Tensor]):
    """``forward(**call)`` on static inputs that keep nothing from an earlier run: the warm-up and the capture run the
    forward on the same buffers, and a value the warm-up derived from one of them is kept on it, sealed for the
    warm-up's call (`_rope_cache.derived`): a tensor made outside the graph, which the capture, another call, must not
    read, and a seal that would leave every layer of the capture computing its own. Forgotten, the capture seals the
    buffers for itself. `_rope_cache.forget` is Python only (no device work), so it is safe inside the capture."""
    from .models._rope_cache import forget  # (here: models' modules import this one)

    for s in static:
        forget(s)
    return forward(**call)


class _Graph:
    """One captured signature: its graph, static input buffers and static outputs (in the shared pool)."""

    __slots__ = ("graph", "inputs", "outputs", "spec", "keep")

    def __init__(self, graph, inputs, outputs, spec, keep=None) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.spec = spec
        self.keep = keep  # device tensors made outside the pool that the graph reads (`_host_ops`)

    def replay(self, tensors: list[torch.Tensor]):
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)
        self.graph.replay()
        # Clone: the next replay of any graph of this model may overwrite these outputs (one shared pool).
        return pytree.tree_unflatten([o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs], self.spec)


class GraphRunner:
    """Captures and replays one model's forward per input signature (see the module doc); `stats` feeds `report`."""

    def __init__(self, name: str, state, off: str | None = None) -> None:
        self.name = name
        self.state = state  # the model's PatchState (its ``quality`` is read per call)
        self.off = off  # why graphs never run for this model (CUDA missing, ...), fixed at patch time
        self.disabled: str | None = None  # why graphs were turned off for good (verification mismatch)
        self.names: tuple[str, ...] = ()
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: dict[tuple, str] = {}  # signatures whose capture failed, with the reason
        self.fingerprint: ModelFingerprint | None = None
        self.pool = None
        self.backend = CudaGraphs()
        self.replays = 0
        self.captures = 0
        self.invalidations = 0
        self.eager: Counter[str] = Counter()
        self.pool_bytes = 0
        self.model_ref: Callable[[], nn.Module | None] | None = None  # set by the model's `GraphForward`
        # one call at a time through the graphs: a replay's static inputs and outputs are shared by every call of
        # its signature (another thread's copy-in between this one's copy-in and replay, or its replay before this
        # one's clone, would hand over the other's result); re-entrant for a forward that calls its model again
        self._lock = threading.RLock()

    # --- the per-call path -------------------------------------------------------------------------------------
    def __call__(self, model: nn.Module, args: tuple, kwargs: dict):
        forward = type(model).forward.__get__(model)  # what nn.Module would call without us
        if self.off is not None or torch.compiler.is_compiling() or torch._C._get_tracing_state():
            return forward(*args, **kwargs)
        with self._lock:
            try:
                self._check_model(model)
                sig, tensors = call_signature(self.names, args, kwargs, self.fingerprint.device)
                host = _host_key(model, self.names, args, kwargs)
            except Unsupported as exc:
                reason = str(exc)
            else:
                sig = (sig, _global_state()) if host is None else (sig, _global_state(), host[0])
                graph = self.graphs.get(sig)
                if graph is not None:
                    self.replays += 1
                    return graph.replay(tensors)
                reason = self.failed.get(sig) or (
                    REASON_TOO_MANY if len(self.graphs) + len(self.failed) >= MAX_SIGNATURES else None)
                if reason is None:
                    return self._capture(forward, sig, args, kwargs, tensors, host and host[1])
            self.eager[reason] += 1
        return forward(*args, **kwargs)  # outside the lock: an eager call shares nothing with another thread's

    def replaced(self, model: nn.Module) -> str | None:
        """Why the model's ``forward`` is no longer this runner's `GraphForward` (a library replaced or wrapped it
        after `patch`; see the module doc), or None. One dict look-up per call."""
        forward = model.__dict__.get("forward")
        if isinstance(forward, GraphForward) and forward.runner is self:
            return None
        who = f"the class's {type(model).__name__}.forward" if forward is None else _callable_name(forward)
        return REASON_REPLACED.format(who=who)

    def _check_model(self, model: nn.Module) -> None:
        if self.disabled is not None:
            raise Unsupported(REASON_DISABLED)
        replaced = self.replaced(model)  # first: nothing below may run a forward through the replacement
        if replaced is not None:
            warn_once(f"diffusers_fastpath: CUDA graphs of {self.name} are paused: {replaced}")
            raise Unsupported(replaced)
        if self.state.quality != "lossless":
            raise Unsupported(f"quality {self.state.quality!r}: CUDA graphs serve the lossless tier only")
        if torch.is_grad_enabled():
            raise Unsupported(REASON_GRAD)
        if model.training:
            raise Unsupported(REASON_TRAINING)
        if global_module_hooks():
            raise Unsupported(REASON_GLOBAL_HOOKS)
        if self.fingerprint is None or not self.fingerprint.matches():
            if self.graphs or self.failed:
                self.invalidations += 1
                logger.info(
                    f"diffusers_fastpath: {self.name} changed (weights moved or replaced, modules, hooks or processors); "
                    f"dropping {len(self.graphs)} CUDA graph(s), re-captured on demand"
                )
            self._drop_graphs()
            self.fingerprint = ModelFingerprint(model, self.backend.device_type)
        if self.fingerprint.blocker is not None:
            raise Unsupported(self.fingerprint.blocker)

    # --- capture and verification ------------------------------------------------------------------------------
    def _capture(self, forward: Callable, sig: tuple, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                 side: Callable[[], Any] | None = None):
        ref = forward(*args, **kwargs)  # the eager result: returned, and the reference the first replay must equal
        self.captures += 1
        try:
            graph = self._record(forward, args, kwargs, tensors, side)
            out = graph.replay(tensors)
        except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured runs eager, once said why
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = (f"capture failed: {type(exc).__name__}" + (f": {first_line}" if first_line else "")
                      + _raised_at(exc))
            self.failed[sig] = reason
            warn_once(  # once per process for each model class and cause, however many signatures or patches
                f"diffusers_fastpath: could not capture a CUDA graph of {self.name}; input signatures where this "
                f"happens run eager (same numbers, more host time). Cause: {reason}"
            )
            return ref
        if not outputs_equal(out, ref):
            self.disable(
                f"the first replay of a captured graph differed from the eager forward ({_describe(sig)}); "
                "graphs are off for this model for good"
            )
            return ref
        self.graphs[sig] = graph
        self.pool_bytes = self.backend.pool_bytes(self.pool)
        return ref

    def _record(self, forward: Callable, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                side: Callable[[], Any] | None = None) -> _Graph:
        static = [torch.empty_like(t) for t in tensors]  # same strides where the input is dense
        for s, t in zip(static, tensors):
            s.copy_(t)
        # By name, in the forward's parameter order: the order in which `call_signature` listed the tensors.
        call = dict(zip(self.names, args), **kwargs)
        it = iter(static)
        static_call = {name: _substitute(call[name], it) for name in self.names if name in call}
        if self.pool is None:  # one pool for all graphs of the model (and a fresh one after they were dropped)
            self.pool = self.backend.new_pool(self.fingerprint.device)
        run, keep = functools.partial(_run_fresh, forward, static_call, static), None
        files = registered(HOST_OPS, forward.__self__)
        if files is not None:
            keep = host_ops = _host_ops.HostOps()  # (what it keeps, the graph reads: it lives as long as the graph)
            device_type = self.backend.device_type

            def run():
                with _host_ops.replayed(host_ops, files, device_type):
                    return _run_fresh(forward, static_call, static)

        with capture_twins_bound(type(forward.__self__)), _side_bound(side):
            graph, out = self.backend.record(self.pool, run)
        outputs, spec = pytree.tree_flatten(out)
        return _Graph(graph, static, outputs, spec, keep)

    # --- state -------------------------------------------------------------------------------------------------
    def disable(self, reason: str) -> None:
        """Turn graphs off for this model for good, with one warning, and free them."""
        self.disabled = reason
        logger.warning(f"diffusers_fastpath: CUDA graphs disabled for {self.name}; it runs eager from now on. Cause: {reason}")
        self.close()

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self.failed.clear()
        self.pool = None  # the old pool is freed with its graphs; the next capture starts a new one
        self.pool_bytes = 0

    def close(self) -> None:
        """Drop every graph, static buffer, the pool and the capture stream (called by `unpatch`)."""
        self._drop_graphs()
        self.fingerprint = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy, pickle, torch.save) keeps the settings and the counters but no CUDA state: graphs,
        # static buffers, the pool and its stream belong to this process and this model's memory. The copy
        # captures its own graphs on demand (its first call per signature runs eager, as after an invalidation).
        state = dict(self.__dict__)
        state.update(graphs={}, failed={}, fingerprint=None, pool=None, pool_bytes=0, model_ref=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # the copy's `GraphForward` may have been rebuilt first (deepcopy, pickle) and set ``model_ref``: keep it
        ref = self.__dict__.get("model_ref")
        self.__dict__.update(state)
        self._lock = threading.RLock()
        if ref is not None:
            self.model_ref = ref

    @property
    def status(self) -> str:
        if self.off is not None:
            return f"off: {self.off}"
        if self.disabled is not None:
            return f"disabled: {self.disabled}"
        model = self.model_ref() if self.model_ref is not None else None
        replaced = self.replaced(model) if model is not None else None
        return "on" if replaced is None else f"paused: {replaced}"

    def stats(self) -> dict[str, Any]:
        static = sum(t.numel() * t.element_size() for g in self.graphs.values() for t in g.inputs)
        return dict(
            status=self.status,
            captured=len(self.graphs),
            replays=self.replays,
            captures=self.captures,
            invalidations=self.invalidations,
            eager=dict(self.eager),
            pool_mib=round(self.pool_bytes / 2**20, 1),
            static_inputs_mib=round(static / 2**20, 1),
        )


def _describe(sig: tuple) -> str:
    args = sig[0]
    return ", ".join(f"{name}={tuple(leaf[0])}" if isinstance(leaf[0], torch.Size) else f"{name}" for name, leaf in args)


class GraphForward:
    """The per-instance ``model.forward`` that routes calls through the model's `GraphRunner`.

    A module-level class, not a closure, so that a patched model pickles and deep-copies: it holds the model by weak
    reference (no reference cycle through the model's ``__dict__``) and, when copied, is rebuilt around the copied
    runner and the copied model (`__reduce__`, `__deepcopy__`). It looks like the forward it replaces to
    ``inspect.signature`` and to the hooks of accelerate and diffusers that wrap it (``functools.update_wrapper``),
    and binds like a bound method (`__get__`) for the libraries that save it and put it back.
    """

    def __init__(self, runner: GraphRunner, model: nn.Module, rebind: bool = False) -> None:
        bound = type(model).forward.__get__(model)
        self.runner = runner
        self.model_ref = weakref.ref(model)
        runner.model_ref = self.model_ref  # what `GraphRunner.status` checks the model's forward on
        self.rebind = rebind  # the instance dict held the class's forward, bound, before us: `undo` puts it back
        self.__signature__ = inspect.signature(bound)  # what inspect.signature(model.forward) gave before
        self.__doc__ = bound.__doc__
        self.__name__ = self.__qualname__ = "forward"

    def __call__(self, *args, **kwargs):
        model = self.model_ref()
        if self.runner.off == "unpatched" and model is not None:  # (held by a hook since `unpatch`)
            if model.__dict__.get("forward") is self:  # put back by a hook that went: nothing of ours stays
                self._give_back(model)
            return type(model).forward(model, *args, **kwargs)
        return self.runner(model, args, kwargs)

    def _give_back(self, model: nn.Module) -> None:
        if self.rebind:
            model.__dict__["forward"] = type(model).forward.__get__(model)
        else:
            del model.__dict__["forward"]

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        # A library that saved ``model.forward`` binds it again when it puts it back (cache-dit 1.5.3's
        # ``disable_cache``: ``model.forward = saved.__get__(model)``), as a bound method binds to itself. So does
        # this; after `unpatch` it stands for the class's forward, so it binds to that, and the model is left as
        # the library alone would leave it.
        model = self.model_ref()
        if self.runner.off == "unpatched" and model is not None:
            return type(model).forward.__get__(model)
        return self

    def undo(self) -> None:
        """Drop every graph and give the model its forward back (`unpatch`). A library hook added since then wraps
        this forward and stays: it now passes straight through."""
        self.runner.off = "unpatched"
        self.runner.close()
        model = self.model_ref()
        if model is not None and model.__dict__.get("forward") is self:
            self._give_back(model)

    def __reduce__(self):
        return (GraphForward, (self.runner, self.model_ref(), self.rebind))

    def __deepcopy__(self, memo: dict) -> "GraphForward":
        return GraphForward(copy.deepcopy(self.runner, memo), copy.deepcopy(self.model_ref(), memo), self.rebind)


def _unpatched_graph_forward(model: nn.Module, fn: Any) -> bool:
    return isinstance(fn, GraphForward) and fn.runner.off == "unpatched" and fn.model_ref() is model


def install(model: nn.Module, state, name: str, backend: CudaGraphs | None = None) -> GraphRunner:
    """Route `model`'s forward through a `GraphRunner`, reversibly (`state`'s undo log); on a machine without
    CUDA, or where the forward is already replaced per instance (a library's wrapper: offloading, caching), only
    record why graphs are off. (``backend`` replaces `CudaGraphs`, for tests of the runner's logic without a GPU.)"""
    runner = model.__dict__.get(GRAPHS_ATTR)
    if runner is not None:
        return runner
    off = None
    prior = model.__dict__.get("forward")
    # a leftover of the class's own, or of an earlier patch's graphs (an offload hook saved it and put it back after
    # `unpatch`: it stands for the class's forward since), wraps nothing
    rebind = prior is not None and (_is_class_forward(model, prior) or _unpatched_graph_forward(model, prior))
    if backend is None and not torch.cuda.is_available():
        off = REASON_NO_CUDA
    elif prior is not None and not rebind:
        off = REASON_WRAPPED_BEFORE.format(who=_callable_name(prior))
    runner = GraphRunner(name, state, off)
    if backend is not None:
        runner.backend = backend
    state.set_attr(model, GRAPHS_ATTR, runner)
    if off is not None:
        warn_once(f"diffusers_fastpath: cuda_graphs=True has no effect on {name}: {off}; it runs eager")
        return runner
    bound = type(model).forward.__get__(model)
    signature = inspect.signature(bound)
    kinds = {p.kind for p in signature.parameters.values()}
    if kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}:
        runner.off = "the forward takes *args, **kwargs or positional-only arguments"
        warn_once(f"diffusers_fastpath: cuda_graphs=True has no effect on {name}: {runner.off}")
        return runner
    runner.names = tuple(signature.parameters)
    forward = GraphForward(runner, model, rebind)
    model.__dict__["forward"] = forward
    state.on_undo(forward.undo)
    logger.info(f"diffusers_fastpath: CUDA graphs on for {name} (captured per input signature on first use)")
    return runner
