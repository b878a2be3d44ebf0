"""diffusers' context parallelism with a patched FLUX transformer: every rank bit-identical to unpatched CP.

    torchrun --nproc-per-node 2 examples/context_parallel.py                          # CPU (gloo), tiny FLUX, Ulysses
    torchrun --nproc-per-node 2 examples/context_parallel.py --device cuda --model flux-dev --ring --steps 10

Builds the transformer (random weights from a named config; no downloads), enables diffusers' context parallelism
(``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))``, or ``ring_degree=N`` with
``--ring``) on an unpatched and on a patched copy (patched before or after ``enable_parallelism``, ``--order``), runs
the same step on both and compares every rank's output with ``torch.equal``. On CUDA it also times the step (CUDA
events, median of ``--steps``) unpatched, patched and patched with CUDA graphs, and prints the ratios. Exits 1 if any
rank's output differs. Ring attention needs an attention backend that returns the log-sum-exp (``_native_cudnn``,
``_native_flash``, flash): ``--backend`` picks one; the CPU has none, so ``--ring`` is CUDA-only. diffusers 0.42.1
refuses a degree of 1 ("Either ring_degree or ulysses_degree must be greater than 1"), so this needs two processes
(two GPUs on CUDA).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist

import diffusers_fastpath as fp
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="flux-tiny", choices=["flux-tiny", "flux-dev"])
    p.add_argument("--ring", action="store_true", help="ring attention instead of Ulysses (CUDA only)")
    p.add_argument("--backend", default=None, help="diffusers attention backend (default: native; ring: _native_cudnn)")
    p.add_argument("--order", default="before", choices=["before", "after"], help="patch before/after enable_parallelism")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--grid", type=int, nargs=2, default=None, help="packed latent grid (default 64 64 flux-dev, 4 4 tiny)")
    p.add_argument("--txt-tokens", type=int, default=None, help="default 512 flux-dev, 8 tiny")
    p.add_argument("--steps", type=int, default=0, help="timed steps per mode on CUDA (0: check only)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        # diffusers places each rank on ``rank % torch.accelerator.device_count()``, which a CPU does not have
        torch.accelerator.device_count = lambda: 1
    dist.init_process_group("nccl" if cuda else "gloo")
    from diffusers import ContextParallelConfig

    dtype = getattr(torch, args.dtype)
    tiny = args.model == "flux-tiny"
    grid = tuple(args.grid or ((4, 4) if tiny else (64, 64)))
    txt = args.txt_tokens or (8 if tiny else 512)
    backend = args.backend or ("_native_cudnn" if args.ring else None)

    def build(patched: bool):
        model = build_flux_transformer(args.model, dtype, args.device, seed=0)
        if backend:
            model.set_attention_backend(backend)
        config = ContextParallelConfig(ring_degree=world) if args.ring else ContextParallelConfig(ulysses_degree=world)
        if patched and args.order == "before":
            fp.patch(model)
        model.enable_parallelism(config=config)
        if patched and args.order == "after":
            fp.patch(model)
        return model

    results, times = {}, {}
    for name, patched in (("unpatched CP", False), ("patched CP", True)):
        model = build(patched)
        inputs = flux_transformer_inputs(model, grid=grid, txt_tokens=txt, seed=1)
        with torch.no_grad():
            results[name] = model(**inputs, return_dict=False)[0]
            if cuda and args.steps:
                times[name] = _time(model, inputs, args.steps)
                if patched:
                    fp.patch(model, cuda_graphs=True)
                    times["patched CP + graphs"] = _time(model, inputs, args.steps)
                    results["patched CP + graphs"] = model(**inputs, return_dict=False)[0]
        if patched and rank == 0:
            _say(str(fp.report(model)))
        del model
    ref = results["unpatched CP"]
    same = {name: torch.equal(out, ref) for name, out in results.items() if name != "unpatched CP"}
    mode = f"{'ring' if args.ring else 'ulysses'} degree {world}"
    line = ", ".join(f"{name} bit-identical: {ok}" for name, ok in same.items())
    _say(f"rank {rank}: {args.model} {args.dtype} {mode}, patched {args.order} enable_parallelism: {line}")
    if times and rank == 0:
        base = times["unpatched CP"]
        _say("  ".join(f"{name}: {ms:.2f} ms ({ms / base:.3f}x)" for name, ms in times.items()))
    ok = torch.tensor(int(all(same.values())), device=ref.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    code = 0 if ok.item() else 1
    del results, ref
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return code


def _say(text: str) -> None:
    """One write per message: the ranks share stdout, and print's separate writes of text and newline interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _time(model, inputs, steps: int) -> float:
    """Median GPU milliseconds of one step (CUDA events; every rank times its own, rank 0 prints)."""
    for _ in range(2):
        model(**inputs, return_dict=False)
    samples = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**inputs, return_dict=False)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization: gloo's worker threads can still hold work objects whose tensors
    # Python owns, and destroying them while the interpreter is torn down aborts the process ("terminate called
    # without an active exception", after every rank has printed its verdict: ~1 run in 10 on a 2-core CPU machine;
    # pytorch/pytorch#179291). Every result is already written and the process groups destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
