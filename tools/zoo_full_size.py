"""One full-size step of zoo models (`diffusers_fastpath.testing.zoo`: the classes the generic path patches), eager
against patched, in one process: bit-identity (``torch.equal`` and md5 of the output), the verification of the first
patched forward, every fused site's fast / fallback calls, and the step time (CUDA events, median).

    python tools/zoo_full_size.py wan-vace hunyuan-framepack sana cogview4 auraflow [--repeats 3]

The benchmark (``python -m diffusers_fastpath.bench --model zoo:NAME``) times more modes; this is the check issue 39
asks for at full size, several models in one GPU command (each built, measured and freed in turn).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time


def _sample(out):
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def _time(fn, repeats: int) -> tuple[float, object]:
    import torch

    times, out = [], None
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def check(name: str, repeats: int) -> str:
    import torch

    import diffusers_fastpath as fp
    from diffusers_fastpath._state import STATE_ATTR, sites_of
    from diffusers_fastpath.testing import zoo

    t0 = time.perf_counter()
    model = zoo.build(name, dtype=torch.bfloat16, device="cuda", full=True)
    kwargs = zoo.inputs(name, model, full=True)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    with torch.no_grad():
        step = lambda: _sample(model(**kwargs)).clone()  # noqa: E731
        step()  # warm-up
        eager_ms, ref = _time(step, repeats)
        fp.patch(model)
        start = time.perf_counter()
        first = step()  # verified: patched and as diffusers wrote it
        torch.cuda.synchronize()
        verify_s = time.perf_counter() - start
        patched = STATE_ATTR in model.__dict__
        sites = [s for m in model.modules() for _, s in sites_of(m)] if patched else []
        for s in sites:
            s.reset()
        patched_ms, out = _time(step, repeats)
    equal = torch.equal(first, ref) and torch.equal(out, ref)
    md5 = hashlib.md5(out.float().cpu().numpy().tobytes()).hexdigest()[:10]
    ref_md5 = hashlib.md5(ref.float().cpu().numpy().tobytes()).hexdigest()[:10]
    fast = sum(s.fast for s in sites)
    reasons: dict[str, int] = {}
    for s in sites:
        for r, n in s.fallback.items():
            reasons[f"{s.op}: {r}"] = reasons.get(f"{s.op}: {r}", 0) + n
    idle = sum(1 for s in sites if not s.fast and not s.fallback)
    fp.unpatch(model)
    del model, kwargs, ref, out, first
    gc.collect()
    torch.cuda.empty_cache()
    return (f"| {name} | {params:.2f} | {eager_ms:.1f} | {patched_ms:.1f} | {patched_ms / eager_ms:.3f} | "
            f"{'yes' if equal and md5 == ref_md5 else 'NO'} (`{md5}`) | {'kept' if patched else 'UNPATCHED'} "
            f"({verify_s:.1f} s) | {len(sites)} ({idle} never called) | {fast} | {reasons or '-'} | "
            f"{time.perf_counter() - t0:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", help="zoo entries with a published config")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one step per model, median of {args.repeats}")
    print("| model | B params | eager ms | patched ms | ratio | bit-identical (md5) | after verification (its "
          "forward) | sites | fast calls | fallbacks | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.names:
        try:
            print(check(name, args.repeats), flush=True)
        except Exception as exc:  # noqa: BLE001 - one model's failure is reported, the others still run
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:300]} |", flush=True)
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
