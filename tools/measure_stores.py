"""What each value kept across blocks saves per step, on a CUDA GPU at the published shapes (issue 43, item 6).

A value computed in one block and reused by the later ones saves the later blocks' kernels; this times those kernels
with CUDA events (median of `--repeats` runs of a whole step's worth), as eager runs them and as the kept value
leaves them:

- ``timestep_silu`` (dropped): FLUX.1-dev's 76 adaLN SiLUs of the one ``[1, 3072]`` bf16 timestep embedding (19 dual
  blocks x 2 + 38 single), Qwen-Image's 120 (60 blocks x 2), against one each;
- ``ernie_cos_sin`` (kept where the forward is sealed): ERNIE-Image's ``cos``/``sin`` of the ``[1, 4216, 1, 128]``
  float32 angle table and their bf16 casts, for q and k in 36 layers, against once;
- ``chroma_outer_mask`` (kept where sealed): Chroma1-HD's ``mask[:, None, None, :] * mask[:, None, :, None]`` of the
  ``[1, 4608]`` mask (512 text + 4096 image tokens) in 57 blocks, against once.

The host side of the checks that decide whether a value may be kept (`models._driver`) is in the benchmark's step
table (*host ms*): ``python -m diffusers_fastpath.bench --model flux-dev --levels step`` and ``--model ernie-image``
at this commit against the one before.

    python tools/measure_stores.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def _time(fn, repeats: int) -> float:
    """Median milliseconds of `fn` on the current stream (two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def silu(calls: int):
    temb = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    return lambda: [F.silu(temb) for _ in range(calls)]


def ernie_trig(calls: int):
    freqs = torch.randn(1, 4216, 1, 128, device="cuda")
    return lambda: [(torch.cos(freqs).to(torch.bfloat16), torch.sin(freqs).to(torch.bfloat16)) for _ in range(calls)]


def outer_mask(blocks: int):
    mask = torch.ones(1, 4608, device="cuda", dtype=torch.bool)
    mask[:, 300:512] = False
    return lambda: [mask[:, None, None, :] * mask[:, None, :, None] for _ in range(blocks)]


def cases() -> dict:
    """Each store's eager and kept work, built on the GPU when asked (not at import: ``--help`` needs none)."""
    return {
        "timestep_silu FLUX.1-dev": (silu(76), silu(1)),
        "timestep_silu Qwen-Image": (silu(120), silu(1)),
        "ernie_cos_sin ERNIE-Image 1024^2": (ernie_trig(36 * 2), ernie_trig(1)),  # q and k of every layer; one build
        "chroma_outer_mask Chroma1-HD 1024^2": (outer_mask(57), outer_mask(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'store':40s} {'eager ms':>10s} {'kept ms':>10s} {'saved ms':>10s}")
    for name, (eager, kept) in cases().items():
        e, k = _time(eager, args.repeats), _time(kept, args.repeats)
        print(f"{name:40s} {e:10.3f} {k:10.3f} {e - k:10.3f}")


if __name__ == "__main__":
    main()
