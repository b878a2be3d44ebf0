"""The fused ops' per-call host (Python) cost, measured on a CPU: what a patched model's fused call spends in the
policy (`ops._policy.FusedOp`), its guard and its verification bookkeeping before and after the kernel.

No GPU is needed: every fused op's guard is told that CPU tensors are CUDA ones (its own checks run, the device and
pointer checks it does last are skipped, as in the tests' emulated kernels) and its kernel is its eager reference.
Three measurements, each the best of several repeats:

- ``forward``: a whole tiny model's forward (default Sana; any zoo entry, or ``flux`` for FLUX.1), eager and patched
  (thread CPU time: the CPU computes too, so only differences mean something), in rounds that alternate between an
  unpatched model and a patched one of the same weights (the machine's drift hits both alike). The patched forward's
  excess over eager is split by running it again with a part taken away: the model-level verification's hooks
  (generic path only), and the fused ops' policy (every fused call runs its stand-in kernel or its fallback
  directly, without guard, hook, switch or counter); what is left is the rewritten forwards' glue (plus what the
  CPU computes differently). Then each op's policy cost inside the forward (its calls timed with and without the
  kernel or fallback they run);
- ``per op``: each fused site's recorded call replayed through the policy with the kernel a stub that returns a
  ready result (so the microseconds are the host cost of the fused call alone, kernel launch excluded), the guard
  alone, and the eager reference on the same (tiny) tensors for scale;
- ``launch``: the kernel entry's own cost (`_build.LazyLauncher` over a registered op) against the op's direct call.

Usage::

    PYTHONPATH=$PWD python tools/host_overhead.py [--model sana|flux|<zoo entry>] [--calls 20000]
    cd $(mktemp -d) && PYTHONPATH=/path/to/repo valgrind --tool=callgrind $(python -c 'import sys; print(sys.executable)') \
        /path/to/repo/tools/host_overhead.py --instructions --forwards 10   # instructions instead of times (minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter, defaultdict

import torch
from torch.nn.attention import SDPBackend

import diffusers_fastpath as fp
from diffusers_fastpath._state import STATE_ATTR, sites_of
from diffusers_fastpath.ops import OPS, attention_bool_mask
from diffusers_fastpath.ops._build import LazyLauncher
from diffusers_fastpath.ops._policy import FusedOp
from diffusers_fastpath.ops.layernorm_scale_shift import layernorm_scale_shift_ref
from diffusers_fastpath.testing import zoo

# the kernel stand-ins whose op's `ref` is not pure eager (layernorm_scale_shift's runs the fused modulate, a second
# policy the GPU kernel does not pay), or where the kernel is torch code the host runs as on the GPU (attention_bool_mask:
# the kernel choice asked, the additive mask kept on the mask through `derived`, whose first use seals it)
_STAND_INS = {"layernorm_scale_shift": layernorm_scale_shift_ref, "attention_bool_mask": attention_bool_mask._kernel}


def _sdpa_choice_as_on_cuda(*args) -> int:
    """attention_bool_mask's question to torch, asked (its host cost), answered as on CUDA: the memory-efficient kernel
    (a CPU's SDPA picks its own, which the op refuses; the tests answer so too)."""
    attention_bool_mask.sdpa_choice(*args)
    return int(SDPBackend.EFFICIENT_ATTENTION)


def _as_if_on_cuda(guard):
    def on_cpu(*args, check_pointers=True):
        reason = guard(*args, check_pointers=False)
        return None if reason == "device cpu" else reason
    return on_cpu


def emulate() -> None:
    """Every op's guard takes CPU tensors as CUDA ones; every kernel is the op's eager expression (or its stand-in);
    no proofs; attention_bool_mask told torch picks the memory-efficient kernel."""
    for op in OPS.values():
        op.guard = _as_if_on_cuda(op.guard)
        op.kernel = _STAND_INS.get(op.name, op.ref)
        op.prove = None
    attention_bool_mask.SDPA_CHOICE = _sdpa_choice_as_on_cuda


def best_us(fn, calls: int, repeats: int = 7) -> float:
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


def build(name: str):
    """A tiny model of `name` (a zoo entry, or ``flux``: FLUX.1) with random bf16 weights (seed 0) and its inputs."""
    if name == "flux":
        from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

        model = build_flux_transformer(dtype=torch.bfloat16)
        return model, flux_transformer_inputs(model)
    model = zoo.build(name, dtype=torch.bfloat16)
    return model, zoo.inputs(name, model)


@contextlib.contextmanager
def without_verifier(model):
    """The model-level verification's hooks (`diffusers_fastpath.verify`) off the model for the duration."""
    verifier = getattr(getattr(model, STATE_ATTR, None), "verifier", None)
    saved = [(hooks, dict(hooks)) for hooks in (model._forward_pre_hooks, model._forward_hooks)]
    for hooks, _ in saved:
        for key, hook in list(hooks.items()):
            if verifier is not None and getattr(hook, "__self__", None) is verifier:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, entries in saved:
            hooks.clear()
            hooks.update(entries)


@contextlib.contextmanager
def without_policy():
    """Every fused call runs its fallback (the eager expression, or the op's exact partial fallback) and nothing
    else: no switch, transform, autocast, hook or guard question, no counter."""
    call, try_fast = FusedOp.__call__, FusedOp.try_fast
    FusedOp.__call__ = FusedOp.try_fast = lambda self, site, *args: (self.fallback or self.ref)(*args)
    try:
        yield
    finally:
        FusedOp.__call__, FusedOp.try_fast = call, try_fast


def forward_variants(name: str, forwards: int) -> tuple[dict, torch.nn.Module, dict]:
    """``{label: run}`` where each run makes `forwards` forwards of a tiny `name` (no grad): eager, patched, and
    patched without the verification's hooks, without the policy, without both; the patched model; its inputs."""
    eager, kwargs = build(name)
    patched, _ = build(name)
    fp.patch(patched)

    def run(model, context=contextlib.nullcontext):
        def forward():
            with context(), torch.no_grad():
                for _ in range(forwards):
                    model(**kwargs)
        return forward

    def neither():
        stack = contextlib.ExitStack()
        stack.enter_context(without_verifier(patched))
        stack.enter_context(without_policy())
        return stack

    variants = {"eager": run(eager), "patched": run(patched),
                "patched, no verification hooks": run(patched, lambda: without_verifier(patched)),
                "patched, no policy": run(patched, without_policy),
                "patched, neither": run(patched, neither)}
    for forward in variants.values():  # (the patched model's first forward: the verified one, generic path)
        forward()
    return variants, patched, kwargs


def forward_times(variants: dict, forwards: int, rounds: int) -> dict[str, float]:
    """µs of one forward per variant: thread time, the best of `rounds`, the variants alternating."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for label, forward in variants.items():
            start = time.thread_time_ns()
            forward()
            best[label] = min(best[label], (time.thread_time_ns() - start) / forwards / 1e3)
    return best


def forward_instructions(variants: dict, forwards: int) -> dict[str, float]:
    """Instructions of one forward per variant, counted by callgrind (run the tool under ``valgrind --tool=callgrind``
    in a folder of its own): a dump before and after each variant's forwards, whose difference is exact and does not
    depend on what else the machine runs (unlike times on a shared CPU; the tiny model's own arithmetic is counted too,
    and under valgrind aten takes its kernels for the CPU features valgrind emulates, so only differences mean
    something). What a dump costs is measured with nothing between two and taken off; the garbage collector waits."""
    import glob
    import os
    import subprocess

    def dump(tag: str) -> int:
        before = set(glob.glob(f"callgrind.out.{os.getpid()}.*"))
        subprocess.run(["callgrind_control", "-d", tag, str(os.getpid())], check=True, capture_output=True)
        (path,) = set(glob.glob(f"callgrind.out.{os.getpid()}.*")) - before
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("summary:"))

    import gc

    gc.collect()
    gc.disable()  # (a collection would fall into whichever variant runs then)
    try:
        idle = []
        for _ in range(3):  # what a dump itself costs (callgrind_control runs as a subprocess), taken off each count
            dump("before")
            idle.append(dump("idle"))
        counts = {}
        for label, forward in variants.items():
            dump("before")
            forward()
            counts[label] = (dump(label.replace(" ", "_").replace(",", "")) - min(idle)) / forwards
    finally:
        gc.enable()
    return counts


def policy_by_op(model, kwargs, forwards: int) -> dict[str, tuple[float, float]]:
    """Per op: (calls, µs of policy) per forward inside `model`'s forward: each outermost fused call's time minus
    what its kernel or fallback took (a fused call inside another's fallback counts for its own op)."""
    spent, inner, calls = Counter(), Counter(), Counter()
    depth = Counter()
    saved = FusedOp.__call__, FusedOp.try_fast, FusedOp._fall_back, {op: op.kernel for op in OPS.values()}

    def timed(method, account):
        def wrapper(self, *args):
            depth[self] += 1
            start = time.perf_counter_ns()
            try:
                return method(self, *args)
            finally:
                depth[self] -= 1
                if account(self):
                    (spent if method is not saved[2] else inner)[self.name] += time.perf_counter_ns() - start
        return wrapper

    def outermost(self):
        calls[self.name] += depth[self] == 0
        return depth[self] == 0

    FusedOp.__call__ = timed(saved[0], outermost)
    FusedOp.try_fast = timed(saved[1], outermost)
    FusedOp._fall_back = timed(saved[2], lambda self: True)
    for op, kernel in saved[3].items():
        def kernel_timed(*args, _kernel=kernel, _name=op.name):
            start = time.perf_counter_ns()
            try:
                return _kernel(*args)
            finally:
                inner[_name] += time.perf_counter_ns() - start
        op.kernel = kernel_timed
    try:
        with torch.no_grad():
            for _ in range(forwards):
                model(**kwargs)
    finally:
        FusedOp.__call__, FusedOp.try_fast, FusedOp._fall_back = saved[:3]
        for op, kernel in saved[3].items():
            op.kernel = kernel
    return {name: (calls[name] / forwards, (spent[name] - inner[name]) / forwards / 1e3) for name in spent}


def record_calls(model, kwargs) -> list[tuple[FusedOp, object, tuple]]:
    """The first call of each (op, site) in one patched forward, as (op, site, args)."""
    seen, calls = set(), []
    original = FusedOp.__call__

    def recording(self, site, *args):
        if (self.name, id(site)) not in seen:
            seen.add((self.name, id(site)))
            calls.append((self, site, args))
        return original(self, site, *args)

    FusedOp.__call__ = recording
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        FusedOp.__call__ = original
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sana")
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing of one fused op")
    parser.add_argument("--forwards", type=int, default=20, help="forwards per timing of the whole model")
    parser.add_argument("--rounds", type=int, default=15, help="timings of the whole model (the best counts)")
    parser.add_argument("--instructions", action="store_true",
                        help="under valgrind --tool=callgrind: count each forward's instructions instead, and stop")
    args = parser.parse_args()
    torch.set_num_threads(1)  # (less noise from the CPU's own compute)
    emulate()
    variants, model, kwargs = forward_variants(args.model, args.forwards)
    sites = [s for m in model.modules() for _, s in sites_of(m)]
    before = sum(s.fast + sum(s.fallback.values()) for s in sites)
    with torch.no_grad():
        model(**kwargs)
    per_forward = sum(s.fast + sum(s.fallback.values()) for s in sites) - before
    if args.instructions:
        best, unit, how = forward_instructions(variants, args.forwards), "instructions", "callgrind"
    else:
        best, unit = forward_times(variants, args.forwards, args.rounds), "us"
        how = f"thread time, best of {args.rounds} rounds of {args.forwards}"
    eager, patched = best["eager"], best["patched"]
    print(f"{args.model} (tiny, bf16, CPU, 1 thread), one forward, {unit} ({how}): eager {eager:.1f}, patched "
          f"{patched:.1f} ({patched - eager:+.1f}; {per_forward} fused calls)")
    for label, value in best.items():
        print(f"  {label:32} {value:12.1f} {value - eager:+12.1f}")
    print(f"  -> the verification's hooks {patched - best['patched, no verification hooks']:+.1f}, the fused ops' "
          f"policy {patched - best['patched, no policy']:+.1f}, the rest (glue, and the CPU's compute of the "
          f"stand-ins) {best['patched, neither'] - eager:+.1f}")
    if args.instructions:
        return
    print(f"\n{'policy inside the forward':26} {'calls':>6} {'us/forward':>11} {'us/call':>8}  (instrumented)")
    split = policy_by_op(model, kwargs, args.forwards * args.rounds)
    for name, (calls, us) in sorted(split.items()):
        print(f"{name:26} {calls:6.1f} {us:11.1f} {us / calls:8.2f}")
    print(f"{'all':26} {sum(c for c, _ in split.values()):6.1f} {sum(u for _, u in split.values()):11.1f}")

    rows = defaultdict(list)
    for op, site, call_args in record_calls(model, kwargs):
        with torch.no_grad():
            ready = op.ref(*call_args)
        kernel, op.kernel = op.kernel, (lambda *a, _ready=ready: _ready)
        try:
            with torch.no_grad():
                reason = op._refusal(call_args)
                total = best_us(lambda: op(site, *call_args), args.calls)
                guard = best_us(lambda: op.guard(*call_args), args.calls)
                ref = best_us(lambda: op.ref(*call_args), max(args.calls // 10, 100))
        finally:
            op.kernel = kernel
        rows[op.name, reason or "fast"].append((total, guard, ref))
    print(f"\n{'op':24} {'sites':>5} {'fused call us':>13} {'guard us':>9} {'eager ref us':>12}  path")
    for (name, path), values in sorted(rows.items(), key=lambda item: (item[0][0], item[0][1] != "fast")):
        n = len(values)
        print(f"{name:24} {n:5} {sum(v[0] for v in values) / n:13.2f} {sum(v[1] for v in values) / n:9.2f} "
              f"{sum(v[2] for v in values) / n:12.2f}  {path}")
    fused = sum(v[0] for values in rows.values() for v in values)
    print(f"host cost of one forward's fused calls (each site once, kernels stubbed): {fused:.1f} us")

    x = torch.empty(4)
    direct = torch.ops.aten.alias.default
    lazy = LazyLauncher(None, "unused")
    lazy._fn = direct
    print(f"\nlaunch: LazyLauncher {best_us(lambda: lazy(x), args.calls):.2f} us, OpOverload "
          f"{best_us(lambda: direct(x), args.calls):.2f} us, its C++ op {best_us(lambda: direct._op(x), args.calls):.2f} us "
          "(torch.ops.aten.alias on a CPU tensor)")


if __name__ == "__main__":
    main()
