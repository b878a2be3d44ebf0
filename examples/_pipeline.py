"""What the examples share: their command line, the pipeline (a tiny random one of a FLUX-architecture family
offline, or any supported pipeline's real weights with ``--model``), and a timed, seeded generation."""

from __future__ import annotations

import argparse
import time
import numpy as np
import torch


# the tiny random pipelines built offline: family -> (the `diffusers_fastpath.testing` builder, its prompt embeddings)
TINY = {"flux": ("tiny_flux_pipeline", "prompt_embeddings"),
        "chroma": ("tiny_chroma_pipeline", "chroma_prompt_embeddings"),
        "flux2": ("tiny_flux2_pipeline", "flux2_prompt_embeddings")}


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a pipeline to load with DiffusionPipeline.from_pretrained, a Hub id or a "
                                        "folder (FLUX.1, FLUX.2, Chroma, SD3.5, Qwen-Image, Z-Image, ...; "
                                        "default: a tiny random one of --family)")
    parser.add_argument("--family", default="flux", choices=sorted(TINY),
                        help="the tiny random pipeline built offline when no --model is given (default: flux)")
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
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
        call_kwargs = dict(prompt=args.prompt)
    else:
        from diffusers_fastpath import testing

        build, embeddings = TINY[args.family]
        pipe = getattr(testing, build)(dtype=dtype, device=args.device, seed=args.seed)
        call_kwargs = getattr(testing, embeddings)(pipe, txt_tokens=64, seed=args.seed + 1)
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

    name = type(pipe).__name__ if args.model else f"tiny random {type(pipe).__name__}"
    title = f"{name} on {args.device}, {args.dtype}, {args.width}x{args.height}, {args.steps} steps"
    return pipe, generate, title


def md5(images: np.ndarray) -> str:
    import hashlib

    return hashlib.md5(images.tobytes()).hexdigest()
