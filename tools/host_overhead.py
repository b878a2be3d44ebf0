"""The fused ops' per-call host (Python) cost, measured on a CPU: what a patched model's fused call spends in the
policy (`ops._policy.FusedOp`), its guard and its verification bookkeeping before and after the kernel.

No GPU is needed: every fused op's guard is told that CPU tensors are CUDA ones (its own checks run, the device and
pointer checks it does last are skipped, as in the tests' emulated kernels) and its kernel is its eager reference.
Three measurements, each the best of several repeats:

- ``forward``: a whole tiny zoo model's forward (default Sana), eager and patched (host time on a CPU: the CPU
  computes too, so only the difference between two versions of this package means something);
- ``per op``: each fused site's recorded call replayed through the policy with the kernel a stub that returns a
  ready result (so the microseconds are the host cost of the fused call alone, kernel launch excluded), the guard
  alone, and the eager reference on the same (tiny) tensors for scale;
- ``launch``: the kernel entry's own cost (`_build.LazyLauncher` over a registered op) against the op's direct call.

Usage::

    PYTHONPATH=$PWD python tools/host_overhead.py [--model sana] [--calls 20000]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.ops import OPS
from diffusers_fastpath.ops._build import LazyLauncher
from diffusers_fastpath.ops._policy import FusedOp
from diffusers_fastpath.testing import zoo


def _as_if_on_cuda(guard):
    def on_cpu(*args, check_pointers=True):
        reason = guard(*args, check_pointers=False)
        return None if reason == "device cpu" else reason
    return on_cpu


def emulate() -> None:
    """Every op's guard takes CPU tensors as CUDA ones; every kernel is the op's reference; no proofs."""
    for op in OPS.values():
        op.guard = _as_if_on_cuda(op.guard)
        op.kernel = op.ref
        op.prove = None


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
    parser.add_argument("--forwards", type=int, default=200, help="forwards per timing of the whole model")
    args = parser.parse_args()
    torch.set_num_threads(1)  # (less noise from the CPU's own compute)
    emulate()
    model = zoo.build(args.model, dtype=torch.bfloat16)
    kwargs = zoo.inputs(args.model, model)

    def forward():
        with torch.no_grad():
            model(**kwargs)

    eager = best_us(forward, args.forwards)
    fp.patch(model)
    forward()  # the verified first forward
    patched = best_us(forward, args.forwards)
    sites = [s for m in model.modules() for _, s in sites_of(m)]
    before = sum(s.fast + sum(s.fallback.values()) for s in sites)
    forward()
    per_forward = sum(s.fast + sum(s.fallback.values()) for s in sites) - before
    print(f"{args.model} (tiny, bf16, CPU, 1 thread): forward eager {eager:.1f} us, patched {patched:.1f} us "
          f"({patched - eager:+.1f} us; {per_forward} fused calls per forward)")

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
