"""What every family builder shares: modules built in place on a device and dtype, random weights that leave no
parameter at a zero or identity init (a fused path fed zeros proves nothing), text masks and FLUX-style ids."""

from __future__ import annotations

import contextlib
import logging
import math

import torch


@contextlib.contextmanager
def _construct(device, dtype):
    """Build modules directly on `device` in `dtype` (no fp32 copy first, and no cast warning from diffusers)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


class _NoTorchvisionFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


@contextlib.contextmanager
def _quiet_image_processor_fallback():
    """Import diffusers' pipeline classes without transformers' notice that an image processor falls back to PIL.

    The modules of FluxPipeline, ChromaPipeline, StableDiffusion3Pipeline and the Bria pipelines import
    ``CLIPImageProcessor`` (and through it ``SiglipImageProcessor``) from transformers at import time. Without
    torchvision, transformers 5 binds the PIL processor in their place and logs a warning for each, which opened
    every example and benchmark run. The pipelines built here hold no image processor (``feature_extractor=None``),
    so the notice says nothing about them: this drops that one message of that one logger (transformers'
    ``import_utils``), while the pipeline module is imported, and nothing else."""
    source = logging.getLogger("transformers.utils.import_utils")
    notice = _NoTorchvisionFallbackNotice()
    source.addFilter(notice)
    try:
        yield
    finally:
        source.removeFilter(notice)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fresh random values for every parameter (zero-initialised layers included), scaled so that activations stay
    in range through deep stacks: matrices N(0, 1/fan_in), norm weights N(1, 0.1), other vectors N(0, 0.05)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {
        id(m.weight) for m in model.modules() if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
        elif id(p) in norm_weights:
            p.normal_(1.0, 0.1, generator=gen)
        else:
            p.normal_(0.0, 0.05, generator=gen)
    return model


def _random_model(cls: type, configs: dict, config, dtype, device, seed: int, overrides: dict) -> torch.nn.Module:
    """`cls` from a named config of `configs` (or a config dict) with `overrides`, built on `device` in `dtype`,
    with `randomize_`'s weights, in eval mode: what every ``build_*`` below does for its family."""
    cfg = {**(configs[config] if isinstance(config, str) else config), **overrides}
    with _construct(device, dtype):
        model = cls(**cfg)
    return randomize_(model, seed).eval()


def _text_mask(batch: int, txt_tokens: int, padding: int) -> torch.Tensor:
    """A ``[batch, txt_tokens]`` long attention mask of ones, the last `padding` tokens of the first prompt zero."""
    mask = torch.ones(batch, txt_tokens, dtype=torch.long)
    if padding:
        mask[0, txt_tokens - padding:] = 0
    return mask


def _latents_and_ids(cfg, batch, grid, txt_tokens, gen, dtype) -> dict:
    """The packed latents and text states of a FLUX-style transformer, image ids laid out on ``grid``, zero text ids."""
    h, w = grid
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=gen).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt_tokens, 3),
    )
