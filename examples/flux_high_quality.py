"""Generate with the "high" quality tier inside a context manager and compare it with lossless (PSNR/SSIM).

    python examples/flux_high_quality.py                                   # offline: a tiny FLUX, random weights
    python examples/flux_high_quality.py --device cuda --height 512 --width 512
    python examples/flux_high_quality.py --model black-forest-labs/FLUX.1-dev --prompt "a tiny astronaut"

By default nothing is downloaded: the pipeline is a tiny FLUX built from a config with random weights, called with
random prompt embeddings. With ``--model`` the real weights are loaded with ``FluxPipeline.from_pretrained``.
The same seed gives an unpatched image, a lossless one (md5-identical to it) and a high one (within PSNR >= 35 dB
and SSIM >= 0.97 of lossless). On a CPU the high tier's sites are mounted but every call falls back to the lossless
path (the fused ops are CUDA-only); the report says so, and the images are then identical.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.metrics import psnr, ssim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="FLUX pipeline to load with from_pretrained (default: a tiny random one)")
    parser.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--height", type=int, default=None, help="default: 1024 with --model, else 128")
    parser.add_argument("--width", type=int, default=None, help="default: 1024 with --model, else 128")
    parser.add_argument("--steps", type=int, default=None, help="default: 28 with --model, else 4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    size = 1024 if args.model else 128
    height, width = args.height or size, args.width or size
    steps = args.steps or (28 if args.model else 4)

    if args.model:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
        call_kwargs = dict(prompt=args.prompt)
    else:
        from diffusers_fastpath.testing import prompt_embeddings, tiny_flux_pipeline

        pipe = tiny_flux_pipeline(dtype=dtype, device=args.device, seed=args.seed)
        call_kwargs = prompt_embeddings(pipe, txt_tokens=64, seed=args.seed + 1)
    pipe.set_progress_bar_config(disable=True)

    def generate() -> tuple[np.ndarray, float]:
        generator = torch.Generator(args.device).manual_seed(args.seed)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        images = pipe(
            **call_kwargs, height=height, width=width, num_inference_steps=steps, generator=generator, output_type="np"
        ).images
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return images, time.perf_counter() - start

    generate()  # warm-up
    unpatched, eager_s = generate()
    fp.patch(pipe)  # the default tier: lossless
    generate()  # warm-up (the first CUDA call builds the extension once per machine)
    lossless, lossless_s = generate()
    with fp.quality(pipe, "high"):  # mounted on entry, restored on exit (also on an exception)
        high, high_s = generate()
        rep = fp.report(pipe)
    after, _ = generate()  # outside the context: lossless again

    md5 = lambda a: hashlib.md5(a.tobytes()).hexdigest()  # noqa: E731
    approx = sum(s.fast for s in rep.tier_sites)
    sent_back = sum(s.fallback for s in rep.tier_sites)
    print(f"{'real' if args.model else 'tiny random'} FLUX pipeline on {args.device}, {args.dtype}, {width}x{height}, {steps} steps")
    print(f"unpatched: {eager_s * 1000:.1f} ms  md5 {md5(unpatched)}")
    print(f"lossless:  {lossless_s * 1000:.1f} ms  md5 {md5(lossless)}  ({lossless_s / eager_s:.3f}x)")
    print(f"lossless identical to unpatched: {md5(lossless) == md5(unpatched)}")
    print(f"high:      {high_s * 1000:.1f} ms  md5 {md5(high)}  ({high_s / eager_s:.3f}x)")
    print(f"high vs lossless: PSNR {psnr(high, lossless):.2f} dB, SSIM {ssim(high, lossless):.5f}")
    print(f"high-tier calls: {approx} on the approximate path, {sent_back} sent to the lossless path"
          + (" (this device has no fused ops: high ran the lossless path)" if approx == 0 and sent_back else ""))
    print(f"after the context: identical to unpatched: {md5(after) == md5(unpatched)}\n")
    print(rep)
    fp.unpatch(pipe)
    return 0 if md5(lossless) == md5(unpatched) == md5(after) else 1


if __name__ == "__main__":
    sys.exit(main())
