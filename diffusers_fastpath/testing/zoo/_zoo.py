"""The zoo's table and its builders (`diffusers_fastpath.testing.zoo` re-exports them; `pipelines` builds on them)."""

from __future__ import annotations

import torch

from .._common import _construct, randomize_
from ._entry import Draw, ZooEntry  # noqa: F401
from .audio import ENTRIES as _AUDIO
from .classic import ENTRIES as _CLASSIC
from .image import ENTRIES as _IMAGE
from .video import ENTRIES as _VIDEO
from .wan import ENTRIES as _WAN

_GROUPS = (_WAN, _VIDEO, _IMAGE, _CLASSIC, _AUDIO)
ZOO: dict[str, ZooEntry] = {k: v for group in _GROUPS for k, v in group.items()}
assert len(ZOO) == sum(map(len, _GROUPS)), "two zoo groups use one name"


def _as_loaded_(model: torch.nn.Module, dtype: torch.dtype, keep_fp32: bool) -> None:
    """Give every state-dict tensor the dtype ``from_pretrained(torch_dtype=dtype)`` loads it in: `dtype`, or fp32 for
    the class's ``_keep_in_fp32_modules`` (a module name equal to one dotted part of the tensor's name, as diffusers'
    loader matches). Persistent buffers built in fp32 whatever the default dtype (OmniGen's ``pos_embed``) are
    loaded from the checkpoint in `dtype` too; non-persistent buffers stay as the class builds them."""
    keep = (getattr(model, "_keep_in_fp32_modules", None) or []) if keep_fp32 else []
    for name, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)


def build(name: str, dtype=torch.bfloat16, device="cpu", seed=0, full=False, keep_fp32=True) -> torch.nn.Module:
    """The model of zoo entry `name` in eval mode, every parameter random.

    Args:
        name: a key of `ZOO`.
        dtype, device: built straight there (a full-size model never exists in fp32 or on the CPU).
        seed: the weights' seed.
        full: the published config instead of the tiny one (`ZooEntry.full_config`; ValueError where unknown).
        keep_fp32: keep the class's ``_keep_in_fp32_modules`` in fp32, as ``from_pretrained`` does.

    Example:
        >>> model = build("sana", dtype=torch.float32)
    """
    entry = ZOO[name]
    if full and entry.full_config is None:
        raise ValueError(f"zoo entry {name!r} has no published config ({entry.notes})")
    cfg = entry.full_config if full else entry.tiny_config
    with _construct(device, dtype):
        model = entry.cls(**cfg)
    _as_loaded_(model, dtype, keep_fp32)
    return randomize_(model, seed).eval()


def inputs(name: str, model: torch.nn.Module, batch=1, seed=1, full=False, **size) -> dict:
    """Fresh random forward kwargs for `model` (built by `build(name)`): tensors on its device and in its dtype,
    timesteps in its scheduler's range, masks / ids / rotary inputs as its pipeline makes them.

    Args:
        batch: samples (the first one's text is padded where the class takes a mask).
        seed: the inputs' seed (different from the weights' by default).
        full: the published resolution (`ZooEntry.full_size`) instead of the tiny one.
        size: resolution knobs of the entry's builder (frames, height, width, text, ...), over the above.

    Example:
        >>> model = build("auraflow")
        >>> kwargs = inputs("auraflow", model, batch=2, height=128, width=128)
    """
    entry = ZOO[name]
    size = {**(entry.full_size if full else {}), **size}
    return entry.inputs_fn(model, Draw(model, seed), batch, **size)
