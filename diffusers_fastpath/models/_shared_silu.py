"""The adaLN SiLU of the timestep embedding, once per forward instead of once per block.

FLUX.1's and SD3's ``AdaLayerNormZero`` (``self.linear(self.silu(emb))``) and Qwen-Image's block modulations
(``nn.Sequential(nn.SiLU(), nn.Linear(...))``) each take the SiLU of the same ``temb`` tensor, which the transformer
computes once per forward and hands to every block: 76 identical kernels a FLUX.1 step, 120 a Qwen-Image step (and a
host launch each). `FastpathSharedSiLU`, swapped in for those ``nn.SiLU`` modules, computes it once per input tensor
and stores the result *on that tensor* (`_rope_cache.derived`), where every later block's SiLU finds it: the same
kernel on the same values, so the same bits, exact by construction.

What it refuses, computing the SiLU as written: an inference tensor (no version counter to tell a write in place), an
input that requires grad with grad enabled (a shared output would change the order in which its gradients
accumulate), a module with hooks or a replaced forward, ``inplace=True``, a ``torch.compile`` trace (which stores
nothing; the compiler deduplicates). A stored result is dropped when its input was written in place since, or when
the result itself was (a consumer writing into its input), so every block reads the values eager would give it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._state import PatchState
from ..quality import hooked
from ._rope_cache import STATS_PREFIX, CacheStats, derived

STATS = STATS_PREFIX + "timestep_silu"  # the model's `report` lists it under caches


class FastpathSharedSiLU(nn.SiLU):
    """``nn.SiLU`` of the timestep embedding, computed once per input tensor and shared by every block that asks
    (see module doc). Adds no parameters; unpatching gives ``nn.SiLU`` back."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or self.inplace or not isinstance(input, torch.Tensor) or input.is_inference()
                or (input.requires_grad and torch.is_grad_enabled()) or hooked(self)):
            return F.silu(input, inplace=self.inplace)

        def compute():
            out = F.silu(input)
            return out, out._version

        return derived(input, ("silu",), compute, self.__dict__.get(STATS),
                       valid=lambda entry: entry[0]._version == entry[1])[0]


def share_silu(state: PatchState, module: nn.Module | None) -> bool:
    """Swap `module` for `FastpathSharedSiLU` if it is exactly a plain ``nn.SiLU`` (the model's swapped SiLUs share
    one `CacheStats`, which `report` shows under caches); True if it was."""
    if type(module) is not nn.SiLU or module.inplace:
        return False
    stats = getattr(state, "shared_silu_stats", None)
    if stats is None:
        stats = state.shared_silu_stats = CacheStats()
    state.swap_class(module, FastpathSharedSiLU)
    state.set_attr(module, STATS, stats)
    return True
