"""Patch a FLUX pipeline, check that the output is bit-identical to unpatched diffusers, and show the report.

    python examples/flux_lossless.py                                   # offline: a tiny FLUX, random weights
    python examples/flux_lossless.py --device cuda --height 512 --width 512
    python examples/flux_lossless.py --model black-forest-labs/FLUX.1-dev --prompt "a tiny astronaut"

By default nothing is downloaded: the pipeline is a tiny FLUX built from a config with random weights, called
with random prompt embeddings (no text encoders). With ``--model`` the real weights are loaded with
``FluxPipeline.from_pretrained`` (a Hub id or a local folder).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np
import torch

import diffusers_fastpath as fp


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
        return images, time.perf_counter() - start

    generate()  # warm-up
    reference, eager_s = generate()
    fp.patch(pipe)  # quality="lossless"
    generate()  # warm-up (the first CUDA call builds the extension once per machine)
    patched, fast_s = generate()

    identical = np.array_equal(reference, patched)
    md5 = lambda a: hashlib.md5(a.tobytes()).hexdigest()  # noqa: E731
    print(f"{'real' if args.model else 'tiny random'} FLUX pipeline on {args.device}, {args.dtype}, {width}x{height}, {steps} steps")
    print(f"unpatched: {eager_s * 1000:.1f} ms  md5 {md5(reference)}")
    print(f"patched:   {fast_s * 1000:.1f} ms  md5 {md5(patched)}  ({fast_s / eager_s:.3f}x)")
    print(f"bit-identical: {identical}\n")
    print(fp.report(pipe))
    fp.unpatch(pipe)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
