"""The one fallback policy that every fused op follows.

- A *guard* decides per call whether the fused kernel can take these inputs. When it cannot, the eager reference
  runs (or the op's exact *fallback*, e.g. eager for a self-verified part and a smaller fused op for the rest) and
  the result is still exact; the reason is counted at the call site. Before the op's own guard, the policy refuses
  where the kernel would skip more than a computation: a module whose call the kernel stands for (a LayerNorm, an
  RMSNorm, a SiLU) that has hooks (`hooked`: its own, a ``forward`` replaced on the instance or on its class, or the
  global ones of ``register_module_forward_hook``), whose eager expression calls the module so that they run; and any
  ``torch.func`` transform (``vmap``, ``grad``, ``jvp``: the kernels read raw pointers that a batched or
  grad-tracking tensor does not have, and record no batching or autograd rule); and autocast (CUDA's runs norms and
  pointwise math in float32: eager's chain is another one there). A guard never raises: one that does (a bug of this
  package) refuses the call, with one warning.
- The first exception from a fused kernel (a failed build, a launch error) logs one warning and disables that op
  for the process; its calls run the eager reference from then on. Running out of GPU memory is not such an error:
  that call, its kernel's memory released, runs the eager reference (which, alone, needs what eager needs: a first
  call's check holds the kernel's result and eager's at once), counted with the reason, and the op stays on (a
  first call's signature stays unchecked until a check completes).
- Inside a CUDA graph capture an error is raised too (the capture failed, not the kernel; see `graphs`).
- Inside ``torch.compile`` tracing nothing is swallowed: the op is emitted as its registered custom op (with a fake
  implementation), and any error is raised. A fallback baked into a graph would lose the fast path for good.
- An op whose exactness depends on the platform (a reduction that must match the order of the kernel eager
  dispatches to) verifies itself: the first fast call of each signature is compared with the eager result by
  ``torch.equal``; a mismatch disables the op for the process, with one warning saying why, and that call returns
  the eager result. Under ``torch.compile`` such an op is emitted only for signatures already verified.
- Every call site counts its fast calls and its fallbacks with their reasons, which `diffusers_fastpath.report`
  shows.

- When no kernels can be had at all (no CUDA compiler, a ROCm build of torch, a failed build: see `_build`), the
  loader warns once for the process and every op disables itself without a warning of its own.

Set ``DIFFUSERS_FASTPATH_DISABLE=1`` to send every fused op to its eager reference (an A/B switch that needs no
code change; read on every call, so setting it after import takes effect; `report` then says why).
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from typing import Callable, Hashable

import torch
from torch import nn
from torch.nn.modules import module as _nn_module  # holds the global hook dicts (mutated in place, never rebound)
from torch.utils import _pytree as pytree

from .._logging import logger, warn_once
from ._build import KernelsUnavailable

HALF_DTYPES = (torch.bfloat16, torch.float16)  # the storage dtypes the fused kernels take
# and the VAEs' copies, convolution bias adds and channel norms (conv_bias, causal_conv3d's and ltx_causal_conv3d's
# buffers, upsample_nearest2x, channel_rmsnorm(_silu), LTX-2's per_channel_rmsnorm(_silu)), which an fp32 VAE (as Wan's
# model card loads it) runs too: copies, one fp32 add, the norms' fp32 tails (their SiLU, and LTX-2's sqrt, proven on
# every fp32 value)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP32_OPS = frozenset({"conv_bias", "causal_conv3d", "ltx_causal_conv3d", "upsample_nearest2x", "channel_rmsnorm",
                      "channel_rmsnorm_silu", "per_channel_rmsnorm", "per_channel_rmsnorm_silu"})  # the ops that do
ENV_DISABLE = "DIFFUSERS_FASTPATH_DISABLE"
REASON_ENV = f"{ENV_DISABLE} is set"
REASON_DISABLED = "op disabled after an error"
REASON_MEMORY = "out of GPU memory (this call: eager's expression runs, the kernel's memory released first)"
REASON_NO_KERNELS = "no CUDA kernels in this process"
REASON_TRANSFORM = "inside a torch.func transform (vmap, grad, jvp)"
REASON_FORWARD_REPLACED = "{}.forward replaced on its class"  # (`forward_replaced`; the class's name)
REASON_AUTOCAST = "autocast is on (it runs norms and pointwise math in float32: eager's expression follows it)"


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (False, at no cost, if CUDA is unused)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def autocast_on(args) -> bool:
    """Whether autocast is on for the device of the first tensor of `args`. CUDA autocast runs layer_norm,
    group_norm, rsqrt, pow, exp, norm, ... in float32 whatever their inputs' dtype, so a bf16 model's eager chain
    there is not the one a kernel reproduces: every fused op refuses. Asked per call, so first the one C call that
    says whether autocast is on for any device (0.1 us; building the tensor's device to ask for it alone is 1 us):
    off everywhere, no tensor's device has it on, except MPS, which that call does not cover (asked by name)."""
    any_on = _any_autocast()
    for a in args:
        if isinstance(a, torch.Tensor):
            return (any_on or a.is_mps) and torch.is_autocast_enabled(a.device.type)
    return False


def _autocast_on_traced(args) -> bool:
    """`autocast_on` as ``torch.compile`` traces it (its questions are constants of the trace)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return torch.is_autocast_enabled(a.device.type)
    return False


_any_autocast = torch._C._is_any_autocast_enabled  # (every autocast device type but MPS, in one C call)
_functorch_active = torch._C._are_functorch_transforms_active


def global_module_hooks() -> bool:
    """Whether forward hooks or pre-hooks registered for every module (``torch.nn.modules.module.
    register_module_forward_hook`` / ``register_module_forward_pre_hook``) exist now: two dict lookups."""
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


_PACKAGE = __name__.split(".")[0]
# class -> (replaced, ((each class of its MRO below nn.Module, the forward in its own dict or None), ...))
_FORWARDS: dict[type, tuple[bool, tuple]] = {}


def _trusted() -> tuple[str, ...]:
    """The folders of torch's and diffusers' sources (the decorators `_written_in_class` lets through)."""
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules.get("diffusers")) if m is not None)


def _written_in_class(owner: type, fn) -> bool:
    """Whether `fn`, the ``forward`` in `owner`'s own dict, is the one `owner`'s class body defines: compiled from the
    file of `owner`'s module under the name ``<owner>.forward`` (a replacement or a wrapper is compiled elsewhere),
    under torch's or diffusers' own decorators alone (``torch.no_grad``, diffusers' ``apply_lora_scale``); a
    ``torch.fx.GraphModule``'s forward is the code fx generated for its class."""
    while getattr(fn, "__wrapped__", None) is not None:
        code = getattr(fn, "__code__", None)
        if code is None or not code.co_filename.startswith(_trusted()):
            return False
        fn = fn.__wrapped__
    code, module = getattr(fn, "__code__", None), sys.modules.get(owner.__module__)
    if code is not None and issubclass(owner, torch.fx.GraphModule):
        return code.co_filename.startswith("<eval_with_key>")
    return (code is not None and getattr(fn, "__qualname__", None) == f"{owner.__qualname__}.forward"
            and code.co_filename == getattr(module, "__file__", None))


def _replaced(own: tuple) -> bool:
    """Whether the forward a module of this MRO runs (`own`: each class's own ``forward`` or None, in MRO order) is
    not the one written: its class's forward, and its parent's where that one calls ``super()`` (diffusers'
    ``WanUpsample`` -> ``nn.Upsample``), or this package's (whose fallback runs the parent's). A parent's forward
    that the class shadows does not run, replaced or not (``FP32LayerNorm``'s own forward, not ``nn.LayerNorm``'s)."""
    for owner, fn in own:
        if fn is None:
            continue
        if owner.__module__.split(".")[0] == _PACKAGE:
            continue
        if not _written_in_class(owner, fn):
            return True
        if "super" not in fn.__code__.co_names:
            return False
    return False


def forward_replaced(module: nn.Module) -> bool:
    """Whether the ``forward`` `module` runs is not the one torch or diffusers wrote for its class (a library replaced
    ``nn.LayerNorm.forward`` or ``RMSNorm.forward`` on the class, or wrapped it): a fused op that stands for the
    module's call would skip the replacement. Read from the classes' own dicts (never through a descriptor), kept per
    class until one of them changes: a dict lookup and an identity check per class of the MRO (about 0.2 us); never
    raises (what cannot be read counts as replaced)."""
    return _class_forward_replaced(type(module))


@torch.compiler.assume_constant_result  # (torch.compile asks it while tracing, of the class as it is then)
def _class_forward_replaced(cls: type) -> bool:
    entry = _FORWARDS.get(cls)
    if entry is not None:
        for owner, fn in entry[1]:
            if owner.__dict__.get("forward") is not fn:
                break
        else:
            return entry[0]
    try:
        own = tuple((c, c.__dict__.get("forward")) for c in cls.__mro__[:cls.__mro__.index(nn.Module)])
        replaced = _replaced(own)
    except Exception:  # noqa: BLE001 - a class this cannot read: the fused op refuses (eager calls the module)
        own, replaced = (), True
    if own:
        _FORWARDS[cls] = (replaced, own)
    return replaced


def hooks_on(module: nn.Module) -> bool:
    """Whether calling `module` runs more than its class's forward: forward hooks or pre-hooks of its own, a
    ``forward`` replaced on the instance, or global module hooks (what a scan of a module tree asks: a module in
    between is still called, whatever its class's forward is)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                or global_module_hooks())


def own_hooks(module: nn.Module) -> bool:
    """`hooks_on` less the global module hooks: what a scan of a whole module tree asks of each module, the global
    hooks asked once (`_rope_cache._closed`)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


class EagerClasses:
    """The module classes an op whose kernel is a module's own ``forward`` takes (diffusers' classes, checked by the
    adapter, and this package's subclasses of them), each with the diffusers class whose ``forward`` is the eager one.
    A class made from one of them by someone else (``torch.nn.utils.parametrize`` gives a parametrized module a
    subclass of its class) is refused by the guard and falls back through its MRO to the diffusers forward."""

    def __init__(self) -> None:
        self._bases: dict[type, type] = {}

    def add(self, cls: type, base: type | None = None) -> None:
        self._bases[cls] = base or cls

    def __contains__(self, cls: type) -> bool:
        return cls in self._bases

    def eager(self, module: nn.Module) -> type:
        """The class whose ``forward`` is `module`'s eager one: the diffusers class of the first class of its MRO
        taken here (its own class where none is)."""
        for cls in type(module).__mro__:
            base = self._bases.get(cls)
            if base is not None:
                return base
        return type(module)

    def refusal(self, module: nn.Module, what: str) -> str | None:
        """The guard's first question: ``None`` where `module` is of a class taken here whose ``forward`` chain is
        the one written (`forward_replaced`), else the reason."""
        if type(module) not in self._bases:
            return f"{type(module).__name__} is not a checked {what}"
        if forward_replaced(module):
            return REASON_FORWARD_REPLACED.format(type(module).__name__)
        return None


def hooked(module: nn.Module) -> bool:
    """Whether skipping `module`'s forward would skip more than its computation: its forward hooks or pre-hooks, a
    ``forward`` replaced on the instance (accelerate's offloading, diffusers' hooks: layerwise casting, group
    offloading, caches), or global module forward hooks. A fused op that reads the module's parameters instead of
    calling it refuses then, and the eager expression calls the module, so they run. (Backward hooks are not asked
    about: every fused op refuses where autograd records, and a module's backward hooks act only then.) Attribute
    and dict lookups only, asked per call: timed the same as the per-module check alone (about 1 us with the call's
    own cost on a loaded CPU). A ``forward`` replaced on the module's class or a class it inherits from counts too
    (`forward_replaced`). Also `diffusers_fastpath.quality.hooked`: the one predicate every fused call asks."""
    return hooks_on(module) or _class_forward_replaced(type(module))


_ENVIRON = os.environ
_ENV_DATA = getattr(_ENVIRON, "_data", None)  # what os.environ's item assignment and deletion keep up to date
_ENV_KEY = _ENVIRON.encodekey(ENV_DISABLE) if _ENV_DATA is not None else None
_TRUE = frozenset(("1", "true", "yes", "on"))


def _env_disabled() -> bool:
    """``DIFFUSERS_FASTPATH_DISABLE`` set to a true value now: read on every fused call, as the one dict lookup
    (0.05 us) under ``os.environ``'s (1 us: it encodes the key and decodes the value each time); any other
    ``os.environ`` object (one that replaced it) is asked the ordinary way."""
    if _ENV_DATA is not None and os.environ is _ENVIRON:
        raw = _ENV_DATA.get(_ENV_KEY)
        if raw is None:
            return False
        value = _ENVIRON.decodevalue(raw)
    else:
        value = os.environ.get(ENV_DISABLE, "")
    return value.strip().lower() in _TRUE


class Site:
    """Counters of one call site of a fused op: calls that took the fast path, and fallbacks by reason."""

    __slots__ = ("op", "fast", "fallback")

    def __init__(self, op: str) -> None:
        self.op = op
        self.fast = 0
        self.fallback: Counter[str] = Counter()

    def reset(self) -> None:
        self.fast = 0
        self.fallback.clear()

    def __repr__(self) -> str:
        return f"Site(op={self.op!r}, fast={self.fast}, fallback={dict(self.fallback)})"


class FusedOp:
    """A fused kernel with its guard, its eager reference and its registered custom op.

    Args:
        name: the op's name (``diffusers_fastpath::<name>``).
        ref: the eager PyTorch expression the kernel reproduces bit for bit.
        guard: ``guard(*args, check_pointers=True) -> str | None``: ``None`` if the kernel takes these inputs,
            else a short reason. Pointer checks are skipped while tracing (fake tensors have no storage).
        kernel: the eager fast path (calls the CUDA extension directly, without the Python custom-op layer).
        custom_op: the registered ``torch.library`` op that ``torch.compile`` sees.
        verify_key: for ops that verify themselves, ``verify_key(*args)`` names the signature (whatever decides the
            platform kernel's order, e.g. dtype and row length) that one ``torch.equal`` check vouches for.
        modules: the positions of the arguments that are modules whose call the kernel stands for (a norm the
            kernel reads the weight and eps of instead of calling it): where one is `hooked`, the call refuses
            before the guard (and before any self-check, so that a hook can never fail one) and the eager
            expression, which calls the module, runs its hooks. Not a module (``None``, the custom ops' stand-in)
            is skipped.
        fallback: what runs instead of the kernel (guard refused, op disabled, unverified under ``torch.compile``);
            defaults to ``ref``. An op that fuses an exact-by-construction op with a self-verified one falls back to
            eager for the verified part only and keeps the other fused; ``ref`` stays the pure eager expression
            that verification compares against.
        prove: for a self-verified op whose result is a function of a small domain, ``prove(*args) -> bool`` checks
            the kernel against ``ref`` on the whole domain of the call's signature (e.g. every bit pattern of a
            unary function's dtype); run once per signature, with the first-call comparison, and a ``False``
            disables the op like a mismatch there.
        probe: for a self-verified op whose agreement with eager may hold on some values only (a convolution run
            channels-last by cuDNN, whose engine for some shapes is another than eager's and sums in another order
            that rounds alike on some inputs: session 39), ``probe(*args)`` yields more argument tuples of the call's
            signature (`wide_like` inputs, as many as `probe_seeds` allows), each checked like the first call's
            (kernel against ``ref``), once per signature; a difference disables the op like a mismatch there. A check
            can show a difference, never prove sameness: each input is one more chance to see it.
    """

    def __init__(
        self,
        name: str,
        *,
        ref: Callable[..., torch.Tensor],
        guard: Callable[..., str | None],
        kernel: Callable[..., torch.Tensor],
        custom_op: Callable[..., torch.Tensor],
        verify_key: Callable[..., Hashable] | None = None,
        fallback: Callable[..., torch.Tensor] | None = None,
        prove: Callable[..., bool] | None = None,
        modules: tuple[int, ...] = (),
        probe: Callable[..., object] | None = None,
    ) -> None:
        self.name = name
        self.ref = ref
        self.guard = guard
        self.kernel = kernel
        self.custom_op = custom_op
        self.verify_key = verify_key
        self.fallback = fallback
        self.prove = prove
        self.modules = modules
        self.probe = probe
        self.verified: set = set()  # signatures whose first fast call matched eager bit for bit
        self.disabled: str | None = None  # why the op was disabled for this process, if it was
        self.disabled_reason = REASON_DISABLED  # what its call sites count while it is
        OPS[name] = self

    @property
    def env_disabled(self) -> bool:
        """``DIFFUSERS_FASTPATH_DISABLE`` is set now (read per call: a dict lookup, about 0.3 us)."""
        return _env_disabled()

    def __call__(self, site: Site | None, *args: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # No try/except here: an error while tracing or running the compiled graph is raised, never swallowed.
            if (
                self.disabled is None
                and not self.env_disabled
                and self._hooks_reason(args) is None
                and not _autocast_on_traced(args)
                and self.guard(*args, check_pointers=False) is None
                and (self.verify_key is None or self.verify_key(*args) in self.verified)
            ):
                return self.custom_op(*args)
            return self._fall_back(*args)
        out = self.try_fast(site, *args)
        return self._fall_back(*args) if out is None else out

    def try_fast(self, site: Site | None, *args: torch.Tensor):
        """The fused kernel's result where the policy lets it run (counted fast on `site`), else ``None`` with the
        reason counted on `site`: for a caller whose alternative is not this op's fallback (a hand-off between blocks
        that, refused, leaves the next block to compute its own part). Not for ``torch.compile`` traces (the caller
        takes its alternative there; the compiler sees no fused op)."""
        # Paid on every fused call (a transformer step makes a hundred or more: tools/host_overhead.py measures it),
        # so each question is its cheapest exact form (`_env_disabled`, `autocast_on`), none builds a string unless
        # it refuses, and every one is still asked on every call.
        if _env_disabled():
            reason = REASON_ENV
        elif self.disabled is not None:
            reason = self.disabled_reason
        else:
            reason = self._refusal(args)
            if reason is None:
                try:
                    out = self.kernel(*args)
                    # (a first call's check holds the kernel's result and eager's at once: more memory than eager)
                    verified = self.verify_key is None or self._verified(out, args)
                except torch.OutOfMemoryError:  # this call only: the fast path stays on, eager's expression runs
                    if capturing():
                        raise
                    out = None  # (released before the fallback allocates eager's result)
                    reason = REASON_MEMORY
                except Exception as exc:  # noqa: BLE001 - any kernel failure falls back, once, loudly
                    if capturing():  # the capture failed, not the kernel: the graph runner says why, eager runs
                        raise
                    self.disable(exc)
                    reason = self.disabled_reason
                else:
                    if not verified:
                        reason = REASON_DISABLED
                    else:
                        if site is not None:
                            site.fast += 1
                        return out
        if site is not None:
            site.fallback[reason] += 1
        return None

    def _hooks_reason(self, args) -> str | None:
        for i in self.modules:
            module = args[i] if i < len(args) else None
            if isinstance(module, nn.Module):
                if hooks_on(module):
                    return f"{type(module).__name__} has hooks"
                if _class_forward_replaced(type(module)):
                    return REASON_FORWARD_REPLACED.format(type(module).__name__)
        return None

    def _refusal(self, args) -> str | None:
        """Why the kernel may not run on `args` now, or ``None``; never raises. A functorch transform is refused
        first (74 ns: the guards read ``data_ptr``, which a batched tensor does not have), then autocast, then hooks
        on the modules the kernel stands for, then the op's guard, whose exception (a bug here) is a refusal too."""
        if _functorch_active():
            return REASON_TRANSFORM
        if autocast_on(args):
            return REASON_AUTOCAST
        try:
            if self.modules:
                reason = self._hooks_reason(args)
                if reason is not None:
                    return reason
            return self.guard(*args)
        except Exception as exc:  # noqa: BLE001 - a guard must never raise: the eager expression runs instead
            warn_once(f"diffusers_fastpath: the guard of the fused op '{self.name}' raised {type(exc).__name__}: "
                      f"{exc}; such calls run the eager PyTorch expression (same numbers, slower)")
            return f"guard raised {type(exc).__name__}"

    def _fall_back(self, *args):
        return (self.fallback or self.ref)(*args)

    def _verified(self, out, args) -> bool:
        try:  # (a key that cannot be read, a bug here: this op off, once, loudly; never its caller's failure)
            key = self.verify_key(*args)
        except Exception as exc:  # noqa: BLE001
            self.disable(exc)
            return False
        if key in self.verified:
            return True
        equal = outputs_equal(out, self.ref(*args))  # (out of memory: raised to `try_fast`, nothing recorded)
        try:
            proven = equal and (self.prove is None or self.prove(*args)) and self._probes_agree(args)
        except torch.OutOfMemoryError:
            raise  # (this call falls back, the signature unchecked: `try_fast`)
        except Exception as exc:  # noqa: BLE001 - the proof runs the kernel too: a failure there falls back, once
            self.disable(exc)
            return False
        if proven:
            self.verified.add(key)
            return True
        self.disable(
            RuntimeError(
                f"the fused kernel is not bit-exact against this platform's eager result for {key} (the eager kernel's "
                "reduction order is not the one the fused kernel reproduces)"
            )
        )
        return False

    def _probes_agree(self, args) -> bool:
        """The kernel equals ``ref`` on every argument tuple ``probe(*args)`` yields (none without a probe) that the
        guard takes and that is the call's signature (a probe standing for another one would vouch for nothing)."""
        if self.probe is not None:
            key = self.verify_key(*args)
            for probe_args in self.probe(*args):
                if self.guard(*probe_args) is not None or self.verify_key(*probe_args) != key:
                    continue
                if not outputs_equal(self.kernel(*probe_args), self.ref(*probe_args)):
                    return False
        return True

    def disable(self, exc: BaseException) -> None:
        """Turn the fast path off for this process after `exc`, with one warning (none where the kernels are missing
        altogether: the loader has said so once for every op)."""
        self.disabled = f"{type(exc).__name__}: {exc}".strip()
        if isinstance(exc, KernelsUnavailable):
            self.disabled_reason = REASON_NO_KERNELS
            return
        self.disabled_reason = REASON_DISABLED
        logger.warning(
            f"diffusers_fastpath: disabling the fused op '{self.name}' for this process; its calls now run the "
            f"eager PyTorch expression (same numbers, slower). Cause: {self.disabled}"
        )

    def reset(self) -> None:
        """Re-enable the op (after fixing what disabled it)."""
        self.disabled = None
        self.verified.clear()

    @property
    def status(self) -> str:
        if self.env_disabled:
            return REASON_ENV
        if self.disabled is not None:
            return f"disabled ({self.disabled})"
        if self.verify_key is not None:
            verified = ", ".join("/".join(map(str, key)) for key in sorted(self.verified))
            return f"enabled, verified for {verified or 'no signature yet'}"
        return "enabled"


REASON_LAYOUT = "x's layout: eager keeps it"  # (`laid_out_contiguous`)


def setting_reader(obj, name: str) -> Callable[[], object]:
    """A function of no arguments that returns ``getattr(obj, name, None)`` now, for a settings object of
    ``torch.backends`` (or None): where the attribute is a ``torch.backends.ContextProp`` (``cudnn.enabled``) or the
    ``fp32_precision`` of a ``torch.backends._FP32Precision`` (``cudnn.conv``), the C getter that the descriptor or
    ``__getattr__`` calls, found once (each read through them costs 0.2-1 us of Python, and the settings are read on
    every call of a verified model and of a CUDA graph); any other attribute (and any torch without those classes)
    is read as it is. Either way the value is the one the attribute gives at the time of the call."""
    backends = torch.backends
    context_prop, fp32_precision = getattr(backends, "ContextProp", None), getattr(backends, "_FP32Precision", None)
    prop = next((c.__dict__[name] for c in type(obj).__mro__ if name in c.__dict__), None)
    if context_prop is not None and isinstance(prop, context_prop) and callable(getattr(prop, "getter", None)):
        return prop.getter
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if (fp32_precision is not None and type(obj) is fp32_precision and name == "fp32_precision" and prop is None
            and getter is not None and isinstance(obj.__dict__.get("backend"), str)
            and isinstance(obj.__dict__.get("op"), str)):
        return functools.partial(getter, obj.backend, obj.op)
    return lambda: getattr(obj, name, None)


def _legacy(get: Callable[[], object]) -> object:
    try:
        return get()
    except RuntimeError:
        return "mixed"


_FP32_PRECISIONS = tuple(setting_reader(obj, "fp32_precision") for obj in (
    torch.backends, getattr(torch.backends.cuda, "matmul", None), torch.backends.cudnn,
    getattr(torch.backends.cudnn, "conv", None), getattr(torch.backends.cudnn, "rnn", None)))
_CUDNN_ALLOW_TF32 = setting_reader(torch.backends.cudnn, "allow_tf32")


def fp32_precision_state() -> tuple:
    """Every setting that decides whether fp32 matmuls and convolutions run in TF32 (or bf16x3), read without raising:
    torch >= 2.9 keeps them per backend and op (``fp32_precision`` of torch.backends, cuda.matmul, cudnn, cudnn.conv,
    cudnn.rnn), and its legacy getters (``torch.get_float32_matmul_precision()``, ``cudnn.allow_tf32``) raise where
    those disagree (the new API used per op); older torch has the legacy ones only. A getter that raises reads as
    "mixed": the per-op settings beside it say which mix. (Each read through `setting_reader`: 2 us, from 6.)"""
    return (*[read() for read in _FP32_PRECISIONS], _legacy(torch.get_float32_matmul_precision),
            _legacy(_CUDNN_ALLOW_TF32))


def tensor_reason(x, dtypes, min_dim: int, shape: str) -> str | None:
    """The head many guards share, for an input `x`: a tensor, of one of `dtypes`, of at least `min_dim` dims (`shape`
    names them in the reason: ``"x not [B, C, *]"``); ``None`` or the reason."""
    if not isinstance(x, torch.Tensor):
        return "input not a tensor"
    if x.dtype not in dtypes:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.dim() < min_dim:
        return f"x not {shape}"
    return None


def autograd_device_reason(x: torch.Tensor, *params: torch.Tensor) -> str | None:
    """The tail most guards share, for an input `x` and a module's tensors `params`: no autograd through any of them,
    x on CUDA, the others on x's device; ``None`` or the reason."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if any(p.device != x.device for p in params):
        return "devices differ"
    return None


def laid_out_contiguous(t: torch.Tensor) -> bool:
    """Whether a result laid out after `t` is contiguous: ``torch.empty_like(t)``'s layout, which is also what
    TensorIterator gives an elementwise op's result whose first input is `t` or a dense copy of it (``t.float()``,
    ``F.silu(t)``). Both order the dimensions by `t`'s strides (aten's ``infer_dense_strides`` and
    ``reorder_dimensions``: an insertion sort from the innermost dimension that leaves one of stride 0 where it is,
    and of two of equal strides puts the larger outside). A fused kernel that writes a contiguous result has eager's
    layout exactly where this holds: for a contiguous `t`, a slice of a projection (strides decreasing), not for a
    permuted view (eager's result keeps its order). Free for a contiguous `t`, about 1 us for a slice in its own order,
    3 us for another layout (CPU timings); never raises."""
    if t.is_contiguous():
        return True
    return _dense_in_order(t.shape, t.stride())


def layout_laid_out_contiguous(sizes: tuple, strides: tuple) -> bool:
    """`laid_out_contiguous` of a tensor of these sizes and strides, read from them alone (a guard that knows the
    layout of a view it would make asks this instead of making it: a view costs about 1 us on the host)."""
    if 0 in sizes:
        return True  # (an empty tensor is contiguous)
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1:
            if stride != expected:
                return _dense_in_order(sizes, strides)
            expected *= size
    return True


def _dense_in_order(sizes, strides) -> bool:
    if all(a > b for a, b in zip(strides, strides[1:])):
        return True
    perm = list(range(len(sizes) - 1, -1, -1))  # innermost first, as aten's
    for i in range(1, len(perm)):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            a, b = perm[d0], perm[d1]
            if strides[a] == 0 or strides[b] == 0:
                continue  # ambiguous: compare with the next one out
            if strides[a] < strides[b]:
                break
            if strides[a] > strides[b] or sizes[a] > sizes[b]:
                perm[d0], perm[d1] = b, a
                d1 = d0
    dims = [d for d in perm if sizes[d] != 1]  # size-1 dimensions do not decide contiguity
    return all(inner > outer for inner, outer in zip(dims, dims[1:]))


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor's bit patterns: a view as the integer type of its element size."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


def tensors_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """``torch.equal``, or else the same dtype, shape and bits: NaNs at the same places with the same payload are
    equal (``torch.equal`` calls NaN unequal to itself), so a NaN that eager produces too is not a mismatch."""
    if torch.equal(x, y):
        return True
    if x.dtype != y.dtype or x.shape != y.shape or not x.is_floating_point() or x.device != y.device:
        return False
    return x.element_size() in _SAME_SIZE_INT and torch.equal(bits(x), bits(y))


def wide_like(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A tensor of x's shape, dtype, device and strides, standard normal values each scaled by a power of two from
    2^-6 to 2^6 (seeded): an input on which sums in another order round to other bits where a same-signature input
    from a model may not (a `FusedOp` probe)."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    values = torch.empty_like(x).normal_(generator=gen)
    return values.mul_(torch.empty_like(x).random_(0, 13, generator=gen).sub_(6).exp2_())


def probe_seeds(*tensors: torch.Tensor, factor: int = 5):
    """The seeds of a `FusedOp` probe's inputs for a call of `tensors`: three where they hold at most 2^20 elements,
    one above; each only while the device has about `factor` times their size free (the probe's inputs, the
    kernel's and eager's results and what each computes on the way: none where memory is short, and the first
    call's own comparison then stands alone, as every other op's does)."""
    count = 3 if sum(t.numel() for t in tensors) <= 1 << 20 else 1
    size = sum(t.numel() * t.element_size() for t in tensors)
    cuda = [t for t in tensors if t.is_cuda]
    for seed in range(count):
        if cuda and torch.cuda.mem_get_info(cuda[0].device)[0] < factor * size + (256 << 20):
            return
        yield seed


def wide_probe(position: int, arity: int | None = None):
    """A `FusedOp` probe for an op whose one tensor argument is at `position`: the call's arguments with that tensor
    `wide_like` (`probe_seeds`'s seeds), the others as they are, those from `arity` on dropped (a request for a
    pending result: the probe compares tensors)."""
    def probe(*args):
        x = args[position]
        for seed in probe_seeds(x):
            yield (*args[:position], wide_like(x, seed), *args[position + 1:arity])
    return probe


def outputs_equal(a, b) -> bool:
    """Bit-identity of two outputs of any structure (a tensor, tuples, a diffusers output): the same structure,
    bit-identical tensors (`tensors_equal`) and equal other leaves. What a fused op's and a CUDA graph's first call
    are checked by."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and len(la) == len(lb) and all(
        tensors_equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else (type(x) is type(y) and x == y)
        for x, y in zip(la, lb)
    )


OPS: dict[str, FusedOp] = {}
