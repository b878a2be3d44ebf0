"""What the FLUX examples share: their command line, the pipeline (a tiny random one offline, or real weights with
``--model``), and a timed, seeded generation."""

from __future__ import annotations

import argparse
import time
import numpy as np
import torch


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="FLUX pipeline to load with from_pretrained (default: a tiny random one)")
    parser.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--height", type=int, default=None, help="default: 1024 with --model, else 128")
    parser.add_argument("--width", type=int, default=None, help="default: 1024 with --model, else 128")
    parser.add_argument("--steps", type=int, default=None, help="default: 28 with --model, else 4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    size = 1024 if args.model else 128
    args.height, args.width = args.height or size, args.width or size
    args.steps = args.steps or (28 if args.model else 4)
    return args


def pipeline(args: argparse.Namespace):
    """``(pipe, generate, title)``: ``generate()`` runs the pipeline with the same seed each time and returns the
    images (numpy) and the seconds it took."""
    dtype = getattr(torch, args.dtype)
    if args.model:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
        call_kwargs = dict(prompt=args.prompt)
    else:
        from diffusers_fastpath.testing import prompt_embeddings, tiny_flux_pipeline

        pipe = tiny_flux_pipeline(dtype=dtype, device=args.device, seed=args.seed)
        call_kwargs = prompt_embeddings(pipe, txt_tokens=64, seed=args.seed + 1)
    pipe.set_progress_bar_config(disable=True)
    cuda = args.device.startswith("cuda")

    def generate() -> tuple[np.ndarray, float]:
        generator = torch.Generator(args.device).manual_seed(args.seed)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        images = pipe(**call_kwargs, height=args.height, width=args.width, num_inference_steps=args.steps,
                      generator=generator, output_type="np").images
        if cuda:
            torch.cuda.synchronize()
        return images, time.perf_counter() - start

    title = (f"{'real' if args.model else 'tiny random'} FLUX pipeline on {args.device}, {args.dtype}, "
             f"{args.width}x{args.height}, {args.steps} steps")
    return pipe, generate, title


def md5(images: np.ndarray) -> str:
    import hashlib

    return hashlib.md5(images.tobytes()).hexdigest()
