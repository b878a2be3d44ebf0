"""Model-level verification: what no family adapter vouches for runs its first forward of each input signature both
ways before it is trusted.

A family adapter is written and tested against one diffusers family; the generic path (`models.generic`) patches a
transformer nobody looked at, from patterns alone. Each pattern is exact by construction and each self-verified
kernel checks itself, but a model can still hold what no pattern foresaw (a statement that reads a moved name in a
way the rewriter's proof does not see, a layout a kernel takes differently). So a generically patched model checks
the *whole forward*: the first call of each input signature (`call_key`: every tensor's shape, strides, dtype and
device, every other argument by value or type, and the process-wide settings that choose kernels) runs patched as
usual and then again as diffusers wrote it (every swapped class and replaced processor put back for that one call,
the same inputs cloned before the patched call, the random number generators reset to the same state), and the two
results are compared bit for bit (``torch.equal``, NaNs by their bits), together with what each call wrote into its
inputs and the state of the generators after it. Equal: the signature is trusted from then on. Different: the
diffusers result is returned, the model is unpatched (`patching.unpatch`), and one warning names the first patched
module whose output differs (found by running both ways once more with a fingerprint of every patched module's
output); `report` says so.

Cost: one extra forward per new signature (a pipeline has one or two: conditional and unconditional calls, each
resolution), none afterwards but computing the key (a few microseconds). Set ``DIFFUSERS_FASTPATH_VERIFY=0`` or pass
``patch(..., verify=False)`` to skip it where the setup was verified before.

What it cannot verify, it does not trust: a call inside a ``torch.compile`` trace or a CUDA graph capture is not
checked (the graph runner's first call of a signature is eager, and that call is); past `MAX_SIGNATURES`
signatures, for arguments that cannot be copied, and while torch forward hooks other than the check's own are on
the model or in it (or global module hooks: `foreign_hooks`; they would run twice, and the model's own change what
the check sees), a call of a signature not yet verified runs as diffusers wrote it; a model whose forward or
blocks another library has replaced with a stateful wrapper (a cache such as cache-dit, diffusers' own block caches),
where a second forward would advance that library's state, is unpatched with the reason, since such a model cannot
be verified without changing what the library computes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import weakref
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._graph_fingerprint import _global_state
from ._logging import logger
from ._state import undo_patch
from .ops._policy import capturing, global_module_hooks, outputs_equal, tensors_equal

ENV_VERIFY = "DIFFUSERS_FASTPATH_VERIFY"
_PLAIN_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)  # immutable leaves: kept, not copied
MAX_SIGNATURES = 32  # per model; beyond, a call of a new signature runs as diffusers wrote it
# the packages whose instance-level forward wrappers and hooks are stateless for a second forward: accelerate's
# offloading, diffusers' hook registry (its stateful hooks are checked one by one), this package's CUDA graphs
_BENIGN_WRAPPERS = ("accelerate", "diffusers", "diffusers_fastpath")
# packages whose modules, added to a model after it was patched (LoRA layers, quantized linears, offloading), compute
# the same on a second forward
_STATELESS_PACKAGES = ("torch", "diffusers", "diffusers_fastpath", "peft", "accelerate", "torchao", "optimum",
                       "bitsandbytes", "gguf", "transformers")

# models unpatched by a failed verification, with the reason (`report` shows it); weak: nothing is kept alive
FAILED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def enabled(verify: bool | None = None) -> bool:
    """Whether model-level verification runs: `verify` if given, else not ``DIFFUSERS_FASTPATH_VERIFY=0``."""
    if verify is not None:
        return verify
    return os.environ.get(ENV_VERIFY, "1").strip().lower() not in ("0", "false", "no", "off")


# --- the key of a call ------------------------------------------------------------------------------------------


def _leaf_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided or not hasattr(value, "untyped_storage"):
            return ("tensor", type(value).__name__, value.layout, tuple(value.shape), value.dtype)
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if value is None or isinstance(value, _PLAIN_TYPES):
        return (type(value), value)
    return (type(value),)  # an object (a cache, a generator): by its type


# the types of argument that a call's key takes as they are, with no pytree flattening, where every argument is of
# one of them (what a pipeline passes a transformer: tensors, None, flags): exactly these types, leaves to pytree too
_FLAT_TYPES = frozenset({torch.Tensor, type(None), bool, int, float, str})


def call_key(args: tuple, kwargs: dict) -> tuple:
    """What decides the path a forward takes, as far as the arguments tell: the structure of the arguments, each
    tensor's shape, strides, dtype, device and whether it requires grad, plain values by value, other objects by
    type; plus the process-wide settings that choose kernels (those the CUDA graphs key on, and grad mode).

    Asked on every call of a verified model (tools/host_overhead.py: 30 us on a CPU, 11 of them pytree's flattening
    and ``str(spec)``, 12 the settings; now 10): where every argument is a tensor (of exactly that class) or a plain
    value, the structure is the number of positional arguments and the others' names in order, which is what
    pytree's spec says of such a call; such a key is a tuple and never equals a flattened call's, whose structure
    is a string."""
    values = (*args, *kwargs.values())
    for value in values:
        if type(value) not in _FLAT_TYPES:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            structure = str(spec)
            break
    else:
        leaves, structure = values, (len(args), *kwargs)
    return (structure, tuple(map(_leaf_key, leaves)), torch.is_grad_enabled(), _global_state())


# --- running a model as diffusers wrote it ------------------------------------------------------------------------


@contextlib.contextmanager
def as_written(state) -> Any:
    """For the duration, every module `state` swapped has its diffusers class back and every processor it replaced
    is the original again; then the patch is as before. A patched forward that another library holds bound
    (diffusers' hooks added after `patch`) runs its object's class's forward, that class being diffusers' now
    (`_state.bound_safe`, `_chains._stale_check`). (One thread: another thread's call of the same model in the
    meantime would run unpatched too, which is exact.)"""
    undone = []
    try:
        for record in reversed(state.records):
            kind = record[0]
            if kind == "class" and type(record[1]) is record[3]:
                record[1].__class__ = record[2]
                undone.append(record)
            elif kind == "processor" and record[1].processor is record[3]:
                _set_processor(record[1], record[2])
                undone.append(record)
        yield
    finally:
        for record in reversed(undone):
            if record[0] == "class":
                record[1].__class__ = record[3]
            else:
                _set_processor(record[1], record[3])


def _set_processor(attn: nn.Module, processor: Any) -> None:
    # not attn.set_processor: that logs, and resets per-instance backend settings; this swap lasts one call
    if isinstance(processor, nn.Module):
        attn._modules["processor"] = processor
    else:
        attn.__dict__["processor"] = processor


def _rng_states(device: torch.device | None) -> tuple:
    cuda = None
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(device)
    return torch.random.get_rng_state(), cuda, device


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, device = states
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _rng_equal(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1], b[1]))


def _copy_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A copy of the call's arguments that a second forward may read and write: tensors cloned (with their layout),
    plain values as they are, other objects (a KV cache the forward fills) deep-copied."""
    def copy_leaf(value):
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                return value.detach().clone(memory_format=torch.preserve_format)
        if value is None or isinstance(value, _PLAIN_TYPES):
            return value
        return copy.deepcopy(value)

    return pytree.tree_map(copy_leaf, (args, kwargs))


def _requires_grad(value: Any) -> bool:
    """Whether a tensor of `value` (an output: a tensor, tuples, a diffusers output) requires grad."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def _plain(*values: Any) -> bool:
    """Whether every leaf of `values` is a tensor or an immutable plain value (nothing a forward could advance)."""
    return all(v is None or isinstance(v, (torch.Tensor, *_PLAIN_TYPES)) for v in pytree.tree_leaves(values))


def _written_forward(model: nn.Module):
    """The model's forward as its caller reaches it, but never through this package's CUDA graphs."""
    forward = model.__dict__.get("forward")
    if forward is None or type(forward).__module__.split(".")[0] == "diffusers_fastpath":
        forward = type(model).forward.__get__(model)
    return forward


def _tensors_equal(a: Any, b: Any) -> bool:
    """Whether every tensor of `a` equals (bit for bit) the tensor at the same place of `b`."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(
        tensors_equal(x, y) for x, y in zip(la, lb) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))


def _device_of(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


def _defined_in(fn: Any) -> str:
    """The module a callable's code was defined in (a bound method's function, a partial's, a callable object's
    class): read from the code's globals, which ``functools.update_wrapper`` does not rename."""
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "func") and not hasattr(fn, "__globals__"):  # functools.partial
        fn = getattr(fn.func, "__func__", fn.func)
    globals_ = getattr(fn, "__globals__", None)
    return globals_.get("__name__", "?") if globals_ is not None else type(fn).__module__


def class_names(model: nn.Module) -> frozenset[str]:
    """The classes of `model`'s modules, by qualified name (what `stateful_wrapper` compares with)."""
    return frozenset(f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules())


def stateful_wrapper(model: nn.Module, known: frozenset[str]) -> str | None:
    """Why a second forward of `model` could change what another library computes, or None: a forward replaced on
    an instance by code from a package other than accelerate, diffusers or this one (a cache that counts its calls,
    such as cache-dit's), a module of a class that was not in the model when it was patched (`known`, from
    `class_names`: blocks wrapped since), or a diffusers hook that says it is stateful (diffusers' block caches)."""
    for name, module in model.named_modules():
        label = f"{type(model).__name__}.{name}" if name else type(model).__name__
        forward = module.__dict__.get("forward")
        if forward is not None and _defined_in(forward).split(".")[0] not in _BENIGN_WRAPPERS:
            return f"{label}.forward is replaced by {_defined_in(forward)} (a wrapper that a second forward could advance)"
        qualified = f"{type(module).__module__}.{type(module).__qualname__}"
        if qualified not in known and qualified.split(".")[0] not in _STATELESS_PACKAGES:
            return f"{label} is a {qualified}, added since the patch (a wrapper that a second forward could advance)"
        registry = module.__dict__.get("_diffusers_hook")
        for hook in (getattr(registry, "hooks", None) or {}).values():
            if getattr(hook, "_is_stateful", False):
                return f"{label} has diffusers' stateful hook {type(hook).__name__} (a cache)"
    return None


def foreign_hooks(model: nn.Module, own: Any) -> str | None:
    """Why a call cannot be checked at the model's boundary, or None: torch forward hooks or pre-hooks that are not
    the verifier's own (`own`'s bound methods), on the model or on any module in it, or global module hooks. The
    model's own hooks change its arguments after the check copied them and its output before or after the check
    reads it; any hook would run again in a second forward (one that counts steps or collects features would
    advance). Such a call runs as diffusers wrote it, once; the signature is checked on a call without them."""
    if global_module_hooks():
        return "global module forward hooks are registered (torch's register_module_forward_hook)"
    for name, module in model.named_modules():
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            if getattr(hook, "__self__", None) is not own:
                label = f"{type(model).__name__}.{name}" if name else type(model).__name__
                return f"{label} has forward hooks"
    return None


# --- localising a mismatch ------------------------------------------------------------------------------------------


def _fingerprint(output: Any) -> tuple:
    """A digest of every tensor of `output` by its bits: equal outputs give equal digests; a differing element
    changes the sum or the position-weighted sum (collisions are possible, and only name the wrong site)."""
    from .ops._policy import bits

    digest = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.element_size() in (1, 2, 4, 8):
            b = bits(leaf.detach()).flatten().to(torch.int64)
            weights = torch.arange(1, b.numel() + 1, device=b.device, dtype=torch.int64)
            digest.append((tuple(leaf.shape), leaf.dtype, int(b.sum()), int((b * weights).sum())))
        elif isinstance(leaf, torch.Tensor):
            digest.append((tuple(leaf.shape), leaf.dtype, int(leaf.detach().to(torch.int64).sum())))
    return tuple(digest)


def _record_outputs(modules: list[tuple[str, nn.Module]], sink: list):
    handles = []
    for name, module in modules:
        def hook(_m, _args, output, name=name):
            sink.append((name, _fingerprint(output)))
        handles.append(module.register_forward_hook(hook))
    return handles


# --- the verifier ---------------------------------------------------------------------------------------------------


class _Pending:
    __slots__ = ("key", "inputs", "rng", "reference", "unpatch")

    def __init__(self, key=None, inputs=None, rng=None, reference=None, unpatch=None):
        self.key = key
        self.inputs = inputs
        self.rng = rng
        self.reference = reference  # an `as_written` context this call runs inside, if it runs as diffusers wrote it
        self.unpatch = unpatch  # the reason to unpatch the model once this call returns


class Verifier:
    """The model-level check of one generically patched model: a forward pre-hook and a forward hook on the model
    (recorded in its undo log), the signatures verified so far, and the calls that ran as diffusers wrote them."""

    def __init__(self, name: str, state, model: nn.Module) -> None:
        self.name = name
        self.state = state
        self.known = class_names(model)  # what `stateful_wrapper` takes as the model's own
        self.verified: set = set()
        self.as_written: Counter[str] = Counter()  # calls run as diffusers wrote them, by reason
        self._local = threading.local()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def install(self, model: nn.Module) -> None:
        self.state.add_hook(model.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True))
        self.state.add_hook(model.register_forward_hook(self.after, with_kwargs=True))
        self.state.verifier = self

    def notes(self) -> list[str]:
        lines = [f"verified as diffusers wrote it: {len(self.verified)} input signature(s), one extra forward each"]
        lines += [f"{n} call(s) ran as diffusers wrote them: {why}" for why, n in self.as_written.items()]
        return lines

    # --- the hooks ----------------------------------------------------------------------------------------------
    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def before(self, model: nn.Module, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling() or capturing():
            self._stack().append(None)
            return None
        try:
            pending = self._prepare(model, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run must not break the call: run as written
            pending = self._run_as_written(f"the check could not run ({type(exc).__name__}: {exc})")
        self._stack().append(pending)
        return None

    def _prepare(self, model: nn.Module, args: tuple, kwargs: dict) -> _Pending | None:
        key = call_key(args, kwargs)
        if key in self.verified:
            return None
        wrapper = stateful_wrapper(model, self.known)
        if wrapper is not None:
            return self._run_as_written(wrapper, unpatch=wrapper)
        hooks = foreign_hooks(model, self)
        if hooks is not None:  # not trusted unchecked: the call runs as written, the model stays patched
            return self._run_as_written(f"{hooks}: the check needs a second forward, which would run them again")
        if len(self.verified) >= MAX_SIGNATURES:
            return self._run_as_written(f"more than {MAX_SIGNATURES} input signatures")
        try:
            inputs = _copy_inputs(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - deepcopy of a foreign object
            return self._run_as_written(f"an argument cannot be copied ({type(exc).__name__})")
        return _Pending(key, inputs, _rng_states(_device_of(model)))

    def _run_as_written(self, why: str, unpatch: str | None = None) -> _Pending:
        self.as_written[why] += 1
        context = as_written(self.state)
        context.__enter__()
        return _Pending(reference=context, unpatch=unpatch)

    def after(self, model: nn.Module, args: tuple, kwargs: dict, output: Any):
        stack = self._stack()
        pending = stack.pop() if stack else None
        if pending is None:
            return None
        if pending.reference is not None:
            pending.reference.__exit__(None, None, None)
            if pending.unpatch is not None:
                self._unpatch(model, pending.unpatch, "cannot be verified")
            return None
        rng_patched = _rng_states(pending.rng[2])
        inputs = _copy_inputs(*pending.inputs)  # what the reference run may write into; pending.inputs stay as given
        reference, rng_reference = self._reference(model, pending, inputs)
        if (outputs_equal(output, reference) and _tensors_equal((args, kwargs), inputs)
                and _rng_equal(rng_patched, rng_reference)):
            self.verified.add(pending.key)
            return None
        where = self._localize(model, pending)
        self._unpatch(model, f"its output differs from diffusers' (first at {where})", "failed verification")
        if (torch.is_grad_enabled() and _requires_grad(output) and _plain(args, kwargs)
                and _tensors_equal((args, kwargs), pending.inputs)):
            # under autograd the caller needs diffusers' result with its graph, on the caller's own tensors (the
            # reference ran without one, on copies): diffusers' run again, now unpatched, from the same generators
            # (only where the arguments are tensors and plain values: a second run could advance a cache object)
            _set_rng_states(pending.rng)
            return _written_forward(model)(*args, **kwargs)
        return reference

    def _reference(self, model: nn.Module, pending: _Pending, inputs: tuple) -> tuple[Any, tuple]:
        """The forward as diffusers wrote it on `inputs`, from the generators' state before the patched call; the
        generators are left where that run leaves them (where diffusers would)."""
        args, kwargs = inputs
        forward = _written_forward(model)
        _set_rng_states(pending.rng)
        with as_written(self.state), torch.no_grad():  # values only: the patched call's result keeps its graph
            out = forward(*args, **kwargs)
        return out, _rng_states(pending.rng[2])

    def _localize(self, model: nn.Module, pending: _Pending) -> str:
        """The first patched module (in call order) whose output differs between the patched and the diffusers run
        of the call's inputs, or the model's output if none does."""
        try:
            modules = [(name, m) for name, m in model.named_modules()
                       if any(r[0] == "class" and r[1] is m for r in self.state.records)]
            runs = []
            for written in (False, True):
                sink: list = []
                handles = _record_outputs(modules, sink)
                try:
                    args, kwargs = _copy_inputs(*pending.inputs)
                    _set_rng_states(pending.rng)
                    forward = type(model).forward.__get__(model)
                    with as_written(self.state) if written else contextlib.nullcontext(), torch.no_grad():
                        forward(*args, **kwargs)
                finally:
                    for h in handles:
                        h.remove()
                runs.append(sink)
            for (name, a), (_, b) in zip(*runs):
                if a != b:
                    return f"{self.name}.{name} ({type(dict(modules)[name]).__name__})"
            if len(runs[0]) != len(runs[1]):
                return f"{self.name}: the patched modules ran {len(runs[0])} times, as written {len(runs[1])}"
        except Exception as exc:  # noqa: BLE001 - naming the site is a courtesy; the mismatch stands
            return f"{self.name} (the site could not be named: {type(exc).__name__}: {exc})"
        return f"{self.name}'s output"

    def _unpatch(self, model: nn.Module, why: str, what: str) -> None:
        FAILED[model] = f"{what}: {why}; unpatched, it runs as diffusers wrote it"
        logger.warning(f"diffusers_fastpath: {self.name} ({type(model).__name__}), patched by the generic path, {what}: "
                       f"{why}. It is unpatched and runs as diffusers wrote it (same numbers, no speed-up).")
        undo_patch(model)
