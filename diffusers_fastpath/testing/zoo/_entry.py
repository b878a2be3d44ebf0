"""What every zoo entry is made of: the `ZooEntry` record and `Draw`, the seeded source of an entry's inputs."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One diffusers transformer class, buildable tiny on CPU and (where known) at its published size.

    Args:
        cls_path: the class by import path (``"diffusers.models.transformers.<module>.<Class>"``); imported lazily,
            so the zoo costs nothing until an entry is built.
        tiny_config: constructor kwargs of the tiny model (1 or 2 blocks of each kind; head dim 64 or 128 and a width
            that is a multiple of 128 where the class allows, so a GPU run of it reaches the fused kernels).
        inputs_fn: ``inputs_fn(model, draw, batch, **size) -> dict`` of forward kwargs as the class's pipeline passes
            them; `draw` is a `Draw`; `size` are the entry's resolution knobs (defaults: tiny).
        full_config: constructor kwargs of the published model (``{}`` = the class defaults); None where unknown.
        full_size: the `size` kwargs of `inputs_fn` at the published resolution (for the bench).
        notes: what is odd about the class (fp32 islands, pipeline-made inputs, CPU limits), with the source of the
            full config.
        cpu_dtype: the dtype the CPU test builds this entry in when bf16 cannot run on CPU (None: the requested one).
        skip: why the CPU test cannot run this entry at all ("" = it runs).
    """

    cls_path: str
    tiny_config: dict
    inputs_fn: Callable
    full_config: dict | None = None
    notes: str = ""
    full_size: dict = dataclasses.field(default_factory=dict)
    cpu_dtype: torch.dtype | None = None
    skip: str = ""

    @property
    def cls(self) -> type:
        import importlib

        module, _, name = self.cls_path.rpartition(".")
        return getattr(importlib.import_module(module), name)


class Draw:
    """Fresh random inputs for one model: seeded on the CPU (the same seed draws the same values on any device), then
    moved to the model's device; floating tensors in the model's dtype unless asked otherwise.

    ``model.dtype`` is diffusers' (it skips the ``_keep_in_fp32_modules`` parameters), so a bf16 model with fp32
    islands still gets bf16 inputs, as from its pipeline."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        self.device = getattr(model, "device", None) or next(model.parameters()).device

    def to(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        """`t` on the model's device; floating tensors in `dtype`, by default the model's (pass fp32 / fp64 for
        positions and timesteps a pipeline keeps in full precision)."""
        if t.is_floating_point():
            return t.to(self.device, dtype or self.dtype)
        return t.to(self.device, dtype) if dtype else t.to(self.device)

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        return self.to(torch.randn(shape, generator=self.gen), dtype)

    def rand(self, *shape, scale=1.0, dtype=None) -> torch.Tensor:
        """Uniform in ``[0, scale)``: a timestep per sample in the scheduler's range (1000 or 1)."""
        return self.to(torch.rand(shape, generator=self.gen) * scale, dtype)

    def randint(self, high, *shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen).to(self.device)

    def mask(self, batch, tokens, padding=None, dtype=torch.long) -> torch.Tensor:
        """A ``[batch, tokens]`` text mask: the first prompt padded (its last `padding` tokens zero, default a quarter),
        the others full, so masked and unmasked rows both run."""
        padding = max(1, tokens // 4) if padding is None else padding
        m = torch.ones(batch, tokens, dtype=dtype)
        if padding:
            m[0, tokens - padding:] = 0
        return m.to(self.device)

    def ids(self, *axes, dtype=torch.float32) -> torch.Tensor:
        """``(prod(axes), len(axes))`` grid positions, as ``torch.cartesian_prod`` of aranges (ints) or tensors."""
        ts = [a if isinstance(a, torch.Tensor) else torch.arange(a) for a in axes]
        grid = torch.cartesian_prod(*ts) if len(ts) > 1 else ts[0][:, None]
        return grid.to(self.device, dtype)


def latent_frames(frames: int, ratio: int = 4) -> int:
    """Latent frames of a video of `frames` frames under a causal VAE of temporal ratio `ratio` (81 -> 21 at 4)."""
    return (frames - 1) // ratio + 1


def ceil_to(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)
