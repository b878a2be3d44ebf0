"""One full-size step of zoo models (`diffusers_fastpath.testing.zoo`: the classes the generic path patches), eager
against patched, in one process: bit-identity (``torch.equal`` and md5 of the output), the verification of the first
patched forward, every fused site's fast / fallback calls, and the step time (CUDA events, median).

    python tools/zoo_full_size.py wan-vace hunyuan-framepack sana cogview4 auraflow [--repeats 3]

The benchmark (``python -m diffusers_fastpath.bench --model zoo:NAME``) times more modes; this is the check issue 39
asks for at full size, several models in one GPU command (each built, measured and freed in turn).

``--generation STEPS`` (issues 40 / 41) runs a whole generation instead, through the model's pipeline of
`diffusers_fastpath.testing.zoo.PIPELINES` with its transformer(s) at the published config (random bf16 weights; the
tiny VAE, scheduler, guider and random prompt embeddings the CPU tests use; CFG where the pipeline runs it): one
2-step eager warm-up (CUDA), one eager call, then ``fp.patch(pipe)`` and two calls (the first verifies each forward
signature's first call, the second is timed), each from a fresh seeded generator; ``torch.equal`` and md5 of the
output and of the final latents, the fused sites' calls in the timed call summed over every patched component.
Images at 1024 x 1024 by default, videos at 25 x 512 x 768 (``--height/--width/--frames``):

    python tools/zoo_full_size.py flux3 qwen-image-21 krea2 ideogram4 bria-fibo2 ltx2 --generation 20
    python tools/zoo_full_size.py flux3 ideogram4 --generation 2 --tiny --device cpu --height 64 --width 64

(the builders that take ``full``: the 2026 families; ``--tiny`` runs any builder's tiny pipeline, a CPU included.)
Either way the exit status is 1 where a model is not identical, lost its patch in the verification, or failed.
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


def _once(fn, device="cuda") -> tuple[float, object]:
    """`fn()`'s result and its time in ms: CUDA events on a CUDA device, the wall clock elsewhere."""
    import torch

    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), out


def _time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        ms, out = _once(fn)
        times.append(ms)
    return statistics.median(times), out


def _md5(*tensors) -> str:
    """The md5 of the tensors' values (as fp32: exact for bf16 / fp16), in order; 10 hex digits."""
    digest = hashlib.md5()
    for t in tensors:
        digest.update(t.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:10]


def _sites(*models) -> list:
    """The fused sites of the patched ones among `models`."""
    from diffusers_fastpath._state import STATE_ATTR, sites_of

    return [s for model in models if STATE_ATTR in model.__dict__ for m in model.modules() for _, s in sites_of(m)]


def _counts(sites) -> tuple[int, int, dict[str, int]]:
    """Fast calls, sites never called, and fallback calls by "op: reason", summed over `sites`."""
    reasons: dict[str, int] = {}
    for s in sites:
        for r, n in s.fallback.items():
            reasons[f"{s.op}: {r}"] = reasons.get(f"{s.op}: {r}", 0) + n
    idle = sum(1 for s in sites if not s.fast and not s.fallback)
    return sum(s.fast for s in sites), idle, reasons


def _row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _header(*columns) -> str:
    return _row(*columns) + "\n" + _row(*["---"] * len(columns))


def _free(device="cuda") -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


CHECK_COLUMNS = ("model", "B params", "eager ms", "patched ms", "ratio", "bit-identical (md5)",
                 "after verification (its forward)", "sites", "fast calls", "fallbacks", "wall")


def check(name: str, repeats: int) -> str:
    import torch

    import diffusers_fastpath as fp
    from diffusers_fastpath._state import STATE_ATTR
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
        verify_ms, first = _once(step)  # verified: patched and as diffusers wrote it
        patched = STATE_ATTR in model.__dict__
        sites = _sites(model)
        for s in sites:
            s.reset()
        patched_ms, out = _time(step, repeats)
    equal = torch.equal(first, ref) and torch.equal(out, ref)
    md5, ref_md5 = _md5(out), _md5(ref)
    fast, idle, reasons = _counts(sites)
    fp.unpatch(model)
    del model, kwargs, ref, out, first
    _free()
    return _row(name, f"{params:.2f}", f"{eager_ms:.1f}", f"{patched_ms:.1f}", f"{patched_ms / eager_ms:.3f}",
                f"{'yes' if equal and md5 == ref_md5 else 'NO'} (`{md5}`)",
                f"{'kept' if patched else 'UNPATCHED'} ({verify_ms / 1e3:.1f} s)",
                f"{len(sites)} ({idle} never called)", fast, reasons or "-", f"{time.perf_counter() - t0:.0f} s")


GENERATION_COLUMNS = ("model", "steps", "size", "eager s", "patched s", "ratio", "bit-identical (md5: output, latents)",
                      "1st patched call (verifying)", "sites", "fast calls", "fallbacks", "wall")


def _sized(call: dict, steps: int, height: int | None, width: int | None, frames: int | None, device) -> dict:
    """`call` for `steps` steps at `height` x `width` x `frames` (those given, of the sizes the call names), its
    tensors on `device`; a per-step guidance schedule (Ideogram 4's ``guidance_schedule``) stretched to `steps`, each
    step taking the weight at its place in the schedule."""
    import torch
    from torch.utils import _pytree as pytree

    call = {**pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), call), "num_inference_steps": steps}
    call.update((k, v) for k, v in (("height", height), ("width", width), ("num_frames", frames)) if k in call and v)
    if "guidance_schedule" in call:
        old = call["guidance_schedule"]
        call["guidance_schedule"] = [old[i * len(old) // steps] for i in range(steps)]
    return call


def _quiet(pipe) -> None:
    """No progress bars (a ModularPipeline's ``set_progress_bar_config`` reaches its top-level blocks only, not the
    denoise loop nested in them)."""
    pipe.set_progress_bar_config(disable=True)
    blocks = list(getattr(getattr(pipe, "_blocks", None), "sub_blocks", {}).values())
    while blocks:
        block = blocks.pop()
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
        blocks.extend(getattr(block, "sub_blocks", {}).values())


def _generate(pipe, call: dict, seed: int, device) -> tuple[list, int]:
    """One generation from a fresh ``torch.Generator(device).manual_seed(seed)``: its output's tensors, then its
    final latents where the pipeline hands them over cheaply (a modular pipeline's ``latents`` state; a
    ``callback_on_step_end``'s last ``latents``, where the output is not the latents already), and how many of
    those."""
    import inspect

    import numpy as np
    import torch
    from diffusers import ModularPipeline
    from torch.utils import _pytree as pytree

    generator = torch.Generator(device).manual_seed(seed)
    latents = []
    if isinstance(pipe, ModularPipeline):  # (returns what `output` names, takes no return_dict)
        state = pipe(**{**call, "output": [call["output"], "latents"]}, generator=generator)
        out, latents = state[call["output"]], [state["latents"]]
    else:
        extra = dict(return_dict=False)
        takes = inspect.signature(pipe.__call__).parameters
        if call.get("output_type") != "latent" and "callback_on_step_end" in takes:
            def keep(pipe_, step, timestep, kwargs):
                latents[:] = [kwargs["latents"].clone()]
                return {}

            extra.update(callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
        out = pipe(**call, generator=generator, **extra)
    leaves = [torch.from_numpy(t) if isinstance(t, np.ndarray) else t for t in pytree.tree_leaves(out)]
    return [t.clone() for t in leaves if isinstance(t, torch.Tensor)] + latents, len(latents)


def generation(name: str, steps: int, height: int | None = None, width: int | None = None, frames: int | None = None,
               device="cuda", full: bool = True, seed: int = 0) -> str:
    """A `steps`-step generation of ``PIPELINES[name]`` (its transformers at the published config where `full`; the
    tiny pipeline otherwise) on `device`, eager then patched (the first patched call verifies, the second is timed),
    as one markdown row: times, bit-identity (``torch.equal`` and md5 of the output and the final latents), the
    fused sites' calls in the timed patched generation. Sizes default to 1024 x 1024 for an image, 512 x 768 x 25
    frames for a video (a call that takes ``num_frames``)."""
    import torch

    import diffusers_fastpath as fp
    from diffusers_fastpath._state import STATE_ATTR
    from diffusers_fastpath.testing.zoo import PIPELINES

    t0 = time.perf_counter()
    pipe, call = PIPELINES[name](full=True, device=device) if full else PIPELINES[name]()
    pipe.to(device)
    _quiet(pipe)
    video = "num_frames" in call
    call = _sized(call, steps, height or (512 if video else 1024), width or (768 if video else 1024), frames or 25,
                  device)
    size = "x".join(str(call[k]) for k in ("num_frames", "height", "width") if k in call) or "default"
    modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    run = lambda: _generate(pipe, call, seed, device)  # noqa: E731
    if torch.device(device).type == "cuda":
        _generate(pipe, _sized(call, 2, None, None, None, device), seed, device)  # warm-up (CUDA's lazy init)
    eager_ms, (ref, n_latents) = _once(run, device)
    fp.patch(pipe)
    try:
        patched = [m for m in modules if STATE_ATTR in m.__dict__]
        verify_ms, (first, _) = _once(run, device)  # each forward signature's first call verified
        kept = bool(patched) and all(STATE_ATTR in m.__dict__ for m in patched)
        sites = _sites(*modules)
        for s in sites:
            s.reset()
        patched_ms, (out, _) = _once(run, device)
        fast, idle, reasons = _counts(sites)
    finally:
        fp.unpatch(pipe)
    equal = len(first) == len(out) == len(ref) and all(torch.equal(a, b) and torch.equal(c, b)
                                                       for a, b, c in zip(first, ref, out))
    split = len(ref) - n_latents
    md5s = [_md5(*out[:split]), _md5(*out[split:]) if n_latents else "-"]
    same = md5s == [_md5(*ref[:split]), _md5(*ref[split:]) if n_latents else "-"]
    n_sites = len(sites)
    del pipe, call, modules, patched, sites, run, ref, first, out
    _free(device)
    return _row(name, steps, size, f"{eager_ms / 1e3:.2f}", f"{patched_ms / 1e3:.2f}", f"{patched_ms / eager_ms:.3f}",
                f"{'yes' if equal and same else 'NO'} (`{md5s[0]}`, `{md5s[1]}`)",
                f"{'kept' if kept else 'UNPATCHED'} ({verify_ms / 1e3:.1f} s)", f"{n_sites} ({idle} never called)",
                fast, reasons or "-", f"{time.perf_counter() - t0:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", help="zoo entries with a published config (--generation: PIPELINES "
                        "entries whose builder takes full=True: the 2026 families)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generation", type=int, metavar="STEPS", help="a STEPS-step generation of each model's "
                        "pipeline (zoo.PIPELINES, its transformers full size) instead of one transformer step")
    parser.add_argument("--height", type=int, help="--generation: default 1024 (an image), 512 (a video)")
    parser.add_argument("--width", type=int, help="--generation: default 1024 (an image), 768 (a video)")
    parser.add_argument("--frames", type=int, help="--generation, a video: default 25")
    parser.add_argument("--device", default="cuda", help="--generation: where it runs (default cuda)")
    parser.add_argument("--tiny", action="store_true", help="--generation: the tiny pipelines (a CPU can run them)")
    args = parser.parse_args()
    import torch

    device = args.device if args.generation else "cuda"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    where = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else device
    if args.generation:
        print(f"{where}, torch {torch.__version__}; a {args.generation}-step generation per model "
              f"({'tiny' if args.tiny else 'full-size transformers'}), one call each way after the patched "
              f"verifying one")
        print(_header(*GENERATION_COLUMNS))
        run = lambda name: generation(name, args.generation, args.height, args.width, args.frames,  # noqa: E731
                                      device, full=not args.tiny)
    else:
        print(f"{where}, torch {torch.__version__}; one step per model, median of {args.repeats}")
        print(_header(*CHECK_COLUMNS))
        run = lambda name: check(name, args.repeats)  # noqa: E731
    ok = True
    for name in args.names:
        try:
            row = run(name)
        except Exception as exc:  # noqa: BLE001 - one model's failure is reported, the others still run
            row = f"| {name} | failed: {type(exc).__name__}: {str(exc)[:300]} |"
        ok &= "| yes (`" in row and "| kept (" in row
        print(row, flush=True)
        _free(device)  # (out of the except block: its traceback holds the failed model's frames)
    if not ok:
        raise SystemExit(1)  # a model not identical, unpatched by its verification, or failed


if __name__ == "__main__":
    main()
