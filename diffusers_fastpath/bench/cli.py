"""The command line: arguments, their checks, and `main` (``python -m diffusers_fastpath.bench``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

from .._logging import logger
from . import quant
from .modes import MODES
from .render import import_pyplot, markdown, plot
from .levels.vae import VAE_MODELS
from .runner import LEVELS, SCHEMA, run, violations
from .subject import (CHROMA_MODELS, DTYPES, ERNIE_MODELS, FLUX2_MODELS, FLUX_MODELS, LTX_MODELS, STEP_MODELS,
                      ZOO_MODELS)

# the default prompt length where the model's own pipeline or its rotary table holds fewer than FLUX's 512 (Lumina2's
# caption axis has axes_lens[0] = 300 positions: Lumina2Pipeline's max_sequence_length is 256; FLUX.1-schnell's
# model card calls its pipeline with max_sequence_length=256; LTXPipeline's default is 128)
TEXT_TOKENS = {"lumina2": 256, "lumina2-tiny": 32, "flux-schnell": 256, "ltx-video": 128, "ltx-video-distilled": 128}
# the default steps where the published model's differ from 28: the few-step distilled models (FLUX.1-schnell and
# FLUX.2-klein 4, LTX-Video's distilled 2B 8) and LTXPipeline's default 50
STEPS = {"flux-schnell": 4, "flux2-klein": 4, "ltx-video": 50, "ltx-video-distilled": 8}
# the default height, width and frames where the published model's differ from 1024x1024 (and 81 frames): LTX-Video's
# 768x512, 121 frames (its model card's)
SIZES = {"ltx-video": (512, 768, 121), "ltx-video-distilled": (512, 768, 121)}
# the models whose VAE alone is benched (``--levels vae``): their transformer is a family's the step level does not
# build here (HunyuanVideo, HunyuanImage-2.1's VAE, Qwen-Image 2.1's)
VAE_ONLY_MODELS = tuple(m for m in VAE_MODELS if m not in STEP_MODELS)
KNOWN_MODELS = (FLUX_MODELS + CHROMA_MODELS + FLUX2_MODELS + LTX_MODELS + ERNIE_MODELS + tuple(STEP_MODELS)
                + ZOO_MODELS + VAE_ONLY_MODELS)


def _parser() -> argparse.ArgumentParser:
    mode_help = "; ".join(f"{m.name}: {m.description}" for m in MODES.values())
    p = argparse.ArgumentParser(prog="python -m diffusers_fastpath.bench", description=sys.modules[__package__].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-tiny",
                   help=f"{', '.join(m for m in KNOWN_MODELS if m not in ZOO_MODELS)}, zoo:NAME[-tiny] for a class "
                        "no family adapter covers (testing.zoo; the generic path), or a FLUX pipeline's Hub id or "
                        "folder (default: flux-tiny)")
    p.add_argument("--modes", help=f"comma-separated subset (default: every available one); eager is always "
                                   f"included. {mode_help}")
    p.add_argument("--levels", default="step,generation", help=f"comma-separated, of {', '.join(LEVELS)} "
                                                               "(default: step,generation)")
    p.add_argument("--kernels", action="store_true", help="add the kernels level (fused ops against eager chains)")
    p.add_argument("--profile", action="store_true", help="add the profile level (one step per mode, by category; with --levels vae alone, one "
                                                            "decode and one encode, eager and patched)")
    p.add_argument("--height", type=int, help="pixels, a multiple of 16 (32 for LTX-Video; default: 1024; 512 for "
                                              "ltx-video(-distilled); 128 for the tiny models)")
    p.add_argument("--width", type=int, help="pixels, a multiple of 16 (32 for LTX-Video; default: 1024; 768 for "
                                             "ltx-video(-distilled); 128 for the tiny models)")
    p.add_argument("--frames", type=int,
                   help="video frames, for the video models (wan-14b, hunyuanvideo-1.5: 4k + 1; ltx-video: 8k + 1; "
                        "default: 81; 121 for ltx-video(-distilled))")
    p.add_argument("--steps", type=int,
                   help="denoising steps of a generation (default: 28; 4 for flux-schnell, flux2-klein and the tiny "
                        "models, 8 for ltx-video-distilled, 50 for ltx-video)")
    p.add_argument("--batch", type=int, default=1, help="images per call (default: 1)")
    p.add_argument("--text-tokens", type=int,
                   help="prompt tokens (default: 512 for FLUX, as FLUX.1-dev's T5 gives; 120 for ERNIE-Image; 256 for "
                        "Lumina2, its pipeline's max_sequence_length, and 32 for lumina2-tiny)")
    p.add_argument("--zoo-size", action="append", default=[], metavar="KNOB=INT",
                   help="a zoo: model's input knob over its published (or tiny) size, repeatable: height, width, "
                        "frames, text, ... and the entries' own (qwen-image-21: cached=1, a KV-cached later step)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per mode (default: 10)")
    p.add_argument("--gen-repeats", type=int, default=1, help="timed generations per mode (default: 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quant", default="none", choices=quant.CHOICES,
                   help="build the transformer quantized through diffusers' backend (default: none). "
                        + "; ".join(f"{q.name}: {q.description}" for q in quant.QUANTS.values()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world",
                   help="prompt for a real model's text encoders")
    p.add_argument("--compile-backend", help="torch.compile backend (default: torch's, inductor)")
    p.add_argument("--compile-mode", help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--json", metavar="PATH", help="write every number (and the conditions) here")
    p.add_argument("--markdown", metavar="PATH", help="also write the markdown report here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    p.add_argument("--from-json", metavar="PATH", help="re-render the report (and --plot) of a saved run; runs nothing")
    p.add_argument("--sensors", action="store_true",
                   help="read the GPU's SM clock, power, temperature and clock-event reasons (NVML, read only) while "
                        "each step is timed")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they go to stderr, on a TTY)")
    return p


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    tiny = args.model.endswith("-tiny")
    if args.model in ZOO_MODELS:  # their inputs are the zoo's (tiny or published sizes)
        args.height, args.width = args.height or 1024, args.width or 1024
    ernie = args.model in ERNIE_MODELS
    height, width, frames = SIZES.get(args.model, (128, 128, 81) if tiny else (1024, 1024, 81))
    args.height, args.width, args.frames = args.height or height, args.width or width, args.frames or frames
    args.steps = args.steps or STEPS.get(args.model, 4 if tiny else 28)
    args.text_tokens = args.text_tokens or TEXT_TOKENS.get(args.model, 120 if ernie else 512)
    for name in ("height", "width"):
        if getattr(args, name) <= 0 or getattr(args, name) % 16:
            p.error(f"--{name} must be a positive multiple of 16 (the VAE's 8x and the 2x2 patches), "
                    f"got {getattr(args, name)}")
    if args.model in LTX_MODELS:
        for name in ("height", "width"):
            if getattr(args, name) % 32:
                p.error(f"--{name}: LTX-Video's VAE compresses 32x (LTXPipeline wants a multiple of 32), got "
                        f"{getattr(args, name)}")
    for name in ("steps", "batch", "text_tokens", "repeats", "gen_repeats", "frames"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    known = args.model in KNOWN_MODELS
    if not known and not (os.path.isdir(args.model) or re.fullmatch(r"[\w.-]+/[\w.-]+", args.model)):
        p.error(f"--model {args.model!r}: give one of {', '.join(KNOWN_MODELS)}, a local "
                "folder or a Hub id (owner/name)")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here (use --device cpu)")
    if args.quant != "none":
        if args.dtype != "bf16":
            p.error(f"--quant {args.quant}: the quantized backends compute in bf16 (use --dtype bf16)")
        reason = quant.unavailable(args.quant, device)
        if reason is not None:
            p.error(f"--quant {args.quant}: {reason}")
    levels = _split(args.levels) + ["kernels"] * args.kernels + ["profile"] * args.profile
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        p.error(f"--levels: unknown level(s) {', '.join(unknown)}; known: {', '.join(LEVELS)}")
    args.levels = [lv for lv in LEVELS if lv in levels]
    if not args.levels:
        p.error("--levels: nothing to run")
    if args.model in VAE_ONLY_MODELS and set(args.levels) - {"vae", "profile"}:
        p.error(f"--model {args.model}: its VAE alone is benched here (--levels vae [--profile])")
    if args.dtype == "fp32" and set(args.levels) - {"vae", "profile"}:
        p.error("--dtype fp32: for the VAE level (--levels vae [--profile]): a transformer's fused ops take bf16 / fp16")
    modes = _split(args.modes) or [
        m.name for m in MODES.values() if not (m.compiled and device.type == "cpu" and not args.compile_backend)
    ]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    modes = ["eager"] + [m for m in modes if m != "eager"]
    args.modes = [m for m in MODES if m in modes]  # registry order
    if args.plot:
        try:
            import_pyplot()
        except RuntimeError as exc:  # before the run, not after an hour of GPU time
            p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark command; returns the exit status (0 ok, 1 a promise of bit-identity broken)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.from_json:
        try:
            result = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--from-json {args.from_json}: {exc}")
        if result.get("schema") != SCHEMA:
            p.error(f"--from-json {args.from_json}: not a benchmark result of schema {SCHEMA}")
    else:
        _check_args(p, args)
        logger.info(f"diffusers_fastpath.bench: {args.model} (quant {args.quant}), modes {args.modes}, "
                    f"levels {args.levels}")
        result = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    report = markdown(result)
    print(report, end="")
    if args.markdown:
        Path(args.markdown).write_text(report)
    if args.plot:
        try:
            plot(result, args.plot)
        except RuntimeError as exc:
            p.error(str(exc))
    return 1 if violations(result) else 0

