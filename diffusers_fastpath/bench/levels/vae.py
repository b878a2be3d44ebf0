"""The VAE level: the model's VAE (random weights, its published config) decoding the run's latents and encoding an
image of the run's size, eager and patched in one process, interleaved call by call; per row the median time of each,
the ratio, whether the outputs are bit-identical (and their md5), and the patched VAE's sites (fast calls and
fallbacks with reasons). It needs no transformer (``--levels vae`` alone builds none)."""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch

from ..subject import DTYPES, PIPELINE_FAMILIES, PIPELINE_MODELS
from ..timing import Clock, equal, md5, progress
from .profile import profile_call


# The VAEs of the step-level models (no pipeline family here) and of the families whose VAE alone is benched: model
# name -> (diffusers class, config). The published configs are the classes' defaults (Wan 2.1's VAE, 8x spatial and 4x
# temporal, 16 latent channels; Qwen-Image's, the same network under its own class; Qwen-Image 2.1's, 16x, RGBA;
# HunyuanVideo's, 8x / 4x; HunyuanVideo-1.5's, 16x / 4x; LTX-2's, 32x / 8x, 128 latent channels) but HunyuanImage-2.1's, which has none (its conversion
# script's: 32x, 64 latent channels); the tiny ones keep the compression.
_TINY_WAN = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
_HUNYUAN_IMAGE = dict(in_channels=3, out_channels=3, latent_channels=64, block_out_channels=(128, 256, 512, 512, 1024, 1024),
                      layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)
# LTX-2's published VAE config names its compression (the class's default formula counts the spatial-only and
# temporal-only downsamplings in both)
_LTX2 = dict(spatial_compression_ratio=32, temporal_compression_ratio=8)
VAE_MODELS = {"wan-14b": ("AutoencoderKLWan", {}), "wan-tiny": ("AutoencoderKLWan", _TINY_WAN),
              "qwen-image": ("AutoencoderKLQwenImage", {}), "qwen-image-tiny": ("AutoencoderKLQwenImage", _TINY_WAN),
              "qwen-image-2.1": ("AutoencoderKLQwenImage21", {}),
              "qwen-image-2.1-tiny": ("AutoencoderKLQwenImage21", dict(base_dim=8, decoder_base_dim=8, z_dim=4,
                                                                        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                                                                        dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1)),
              "hunyuanvideo": ("AutoencoderKLHunyuanVideo", {}),
              "hunyuanvideo-tiny": ("AutoencoderKLHunyuanVideo", dict(block_out_channels=(32, 32, 32, 32),
                                                                      norm_num_groups=8, layers_per_block=1)),
              "hunyuanvideo-1.5": ("AutoencoderKLHunyuanVideo15", {}),
              "hunyuanvideo-1.5-tiny": ("AutoencoderKLHunyuanVideo15", dict(block_out_channels=(8, 16, 16, 32, 32),
                                                                            latent_channels=4, layers_per_block=1)),
              "ltx2": ("AutoencoderKLLTX2Video", _LTX2),
              "ltx2-tiny": ("AutoencoderKLLTX2Video", {**_LTX2, "latent_channels": 8,
                                                       "block_out_channels": (8, 16, 32, 32),
                                                       "decoder_block_out_channels": (8, 16, 32),
                                                       "layers_per_block": (1, 1, 1, 1, 1),
                                                       "decoder_layers_per_block": (1, 1, 1, 1)}),
              "hunyuan-image": ("AutoencoderKLHunyuanImage", _HUNYUAN_IMAGE),
              "hunyuan-image-tiny": ("AutoencoderKLHunyuanImage", {**_HUNYUAN_IMAGE, "latent_channels": 8,
                                                                   "block_out_channels": (32, 32, 64, 64, 64, 64),
                                                                   "layers_per_block": 1})}
_SAMPLE_CHANNELS = {"AutoencoderKLQwenImage21": 4}  # the sample's channels where they are not RGB (Qwen-Image 2.1: RGBA)
_ONE_FRAME = {"AutoencoderKLQwenImage21"}  # image VAEs of a video network (their config keeps its temporal factor)


def build_vae(args: argparse.Namespace, device: torch.device):
    """The VAE of ``--model`` (its pipeline family's builder and config, or `VAE_MODELS`', random weights), or
    ``(None, reason)``."""
    if args.model in VAE_MODELS:
        import diffusers

        from ...testing._common import _random_model

        cls, config = VAE_MODELS[args.model]
        return _random_model(getattr(diffusers, cls), {}, config, DTYPES[args.dtype], device, args.seed + 1, {}), None
    if args.model not in PIPELINE_MODELS:
        return None, (f"no VAE config of {args.model} is published with this package (VAE models: "
                      f"{', '.join((*PIPELINE_MODELS, *VAE_MODELS))})")
    family, _, config = PIPELINE_MODELS[args.model]
    return PIPELINE_FAMILIES[family].builder("vae")(config, DTYPES[args.dtype], device, args.seed + 1), None


def _frames(vae, frames: int) -> tuple[tuple, tuple]:
    """The frame dimension of the latents and of the sample: ``()`` for an image VAE (``[B, C, H, W]``); a video VAE's
    latent frames (LTX-Video's 8x, Wan's 4x in time); ``(1,)`` for Qwen-Image's and Qwen-Image 2.1's, Wan's network on
    one frame."""
    if type(vae).__name__ in _ONE_FRAME:
        return (1,), (1,)
    temporal = getattr(vae, "temporal_compression_ratio", None) or getattr(vae.config, "scale_factor_temporal", None)
    if temporal:
        return ((frames - 1) // temporal + 1,), (frames,)
    if "z_dim" in vae.config:
        return (1,), (1,)
    return (), ()


def _sites(model) -> dict[str, Any]:
    from ... import report

    rows = report(model).sites
    reasons: dict[str, int] = {}
    for r in rows:
        for reason, n in r.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
    return dict(sites=len(rows), fast=sum(r.fast for r in rows), fallback=sum(r.fallback for r in rows),
                reasons=reasons)


def run_vae(args: argparse.Namespace, device: torch.device, show: bool, profile: bool = False) -> dict[str, Any]:
    """Time each call (decode, encode) eager and patched; with ``profile``, one more call of each under the profiler
    (`profile_call`: kernels by category, so the convolutions' share, the floor fusion leaves, is read beside the rest)."""
    from ... import UnsupportedModelError, patch

    vae, reason = build_vae(args, device)
    if vae is None:
        return dict(ran=False, reason=reason, rows=[])
    try:
        patched = patch(copy.deepcopy(vae))
    except UnsupportedModelError as exc:  # a VAE class no adapter takes
        return dict(ran=False, reason=f"fp.patch does not take {type(vae).__name__} yet ({exc})", rows=[])
    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    dtype = DTYPES[args.dtype]
    scale = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    # a video VAE (LTX-Video's, Wan's) takes [B, C, frames, H, W]
    latent_frames, frames = _frames(vae, args.frames)
    channels = getattr(vae.config, "latent_channels", None) or vae.config.z_dim
    latents = torch.randn(args.batch, channels, *latent_frames, args.height // scale, args.width // scale,
                          generator=gen, device=device).to(dtype)
    sample_channels = _SAMPLE_CHANNELS.get(type(vae).__name__, 3)
    image = (torch.rand(args.batch, sample_channels, *frames, args.height, args.width, generator=gen, device=device)
             * 2 - 1).to(dtype)
    calls = {"decode": (lambda m: m.decode(latents).sample, latents),
             "encode": (lambda m: m.encode(image).latent_dist.mean, image)}
    clock = Clock(device)
    rows, profiles = [], {}
    with progress(2 * len(calls) * (args.repeats + 1), "vae", show) as bar:
        for name, (call, inp) in calls.items():
            outs, ms = {}, {"eager": [], "patched": []}
            for model, mode in ((vae, "eager"), (patched, "patched")):  # warm-up: the ops' first-call checks
                outs[mode] = clock.time(lambda: call(model))[0]
                bar.update()
            for _ in range(args.repeats):
                for model, mode in ((vae, "eager"), (patched, "patched")):
                    ms[mode].append(clock.time(lambda: call(model))[1])
                    bar.update()
            eager_ms, patched_ms = statistics.median(ms["eager"]), statistics.median(ms["patched"])
            rows.append(dict(call=name, input_shape=list(inp.shape), eager_ms=eager_ms, patched_ms=patched_ms,
                             ratio=patched_ms / eager_ms, eager_ms_all=ms["eager"], patched_ms_all=ms["patched"],
                             bit_identical=equal(outs["patched"], outs["eager"]), md5_eager=md5(outs["eager"]),
                             md5_patched=md5(outs["patched"])))
            if profile:
                profiles[name] = [dict(mode=mode, **profile_call(lambda: call(model), clock))
                                  for model, mode in ((vae, "eager"), (patched, "patched"))]
    return dict(ran=True, reason=None, vae=type(vae).__name__, rows=rows, sites=_sites(patched), profile=profiles)


def vae_markdown(vae: dict[str, Any] | None) -> list[str]:
    """The level's section of the markdown report (nothing when it was not requested)."""
    if not vae or (not vae["ran"] and vae["reason"] == "not requested"):
        return []
    if not vae["ran"]:
        return [f"VAE level: {vae['reason']}.", ""]
    s = vae["sites"]
    lines = [f"### VAE ({vae['vae']}): eager and patched in one process, interleaved (median ms, GPU time on CUDA; "
             f"patched sites: {s['sites']}, {s['fast']} fast calls, {s['fallback']} fallbacks"
             + (f" {s['reasons']}" if s["reasons"] else "") + ")", "",
             "| call | input | eager ms | patched ms | ratio | bit-identical |", "|---|---|---|---|---|---|"]
    for r in vae["rows"]:
        lines.append(f"| {r['call']} | {tuple(r['input_shape'])} | {r['eager_ms']:.2f} | {r['patched_ms']:.2f} | "
                     f"{r['ratio']:.3f}x | {r['bit_identical']} |")
    return lines + [""]
