"""FLUX.1's rotary tables (``FluxPosEmbed``) in 6 kernels instead of 41: the same values, built once per forward.

``FluxPosEmbed.forward`` builds, for each of its three position axes, the axis' inverse frequencies (five kernels),
their outer product with the axis' positions, its cosine and sine, each repeated twice along the columns and cast to
float32, and concatenates the three axes: 41 small kernels that the host issues at the start of every forward, while
the GPU waits (no block can start before the table exists). In a lossless step without CUDA graphs the H200 sat idle
for the first 2.3-2.9 ms of each step on its machine's host, this among the rest (`docs/results`).

Every value of the table is elementwise in the positions: ``float32(cos(double(p) * f))`` for the position ``p`` of
a column's axis and that column's inverse frequency ``f`` (``torch.outer`` is ``p[:, None] * f`` in the common dtype,
float64; the repeat duplicates each column). `FastpathFluxPosEmbed` computes all columns at once, each already in
its place (the positions gathered to their columns, one product, one ``cos`` and one ``sin`` of the duplicated
columns, one cast each): the same operations on the same operands, so the same bits. The inverse frequencies depend only on the module's ``theta`` and ``axes_dim`` and the device; they
are computed with diffusers' own expression on that device and kept on the module, keyed on all three (a constant
of the config, like a buffer: nothing a forward's inputs decide is kept across forwards; see `_rope_cache`).

Where diffusers takes another path (a device without float64, NPU, ids of other axes) and under ``torch.compile``,
the module runs diffusers' ``forward``; while a CUDA graph is being captured the constants are never built (they
would live in the graph's memory pool). The two diffusers functions this relies on are checked by source digest.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed, maybe_adjust_dtype_for_device
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from .._state import PatchState
from ..ops._policy import capturing
from ._mirror import mirrors

_POS_EMBED_FORWARD = "86699659bfe2af8b"  # FluxPosEmbed.forward, diffusers 0.42.1
_GET_1D_ROTARY = "0734204c538630d0"  # get_1d_rotary_pos_embed, diffusers 0.42.1
_CONSTANTS = "_fastpath_rope_constants"  # (key, inverse frequencies, column -> axis)


def _constants(module: FluxPosEmbed, device: torch.device):
    """The inverse frequency of every column of the table (diffusers' expression per axis, float64, on `device`;
    each twice, as the table repeats it) and each column's axis, kept on `module` for its ``theta`` and ``axes_dim``
    on that device; ``None`` while a CUDA graph is being captured and they are not there yet."""
    key = (device, module.theta, tuple(module.axes_dim))
    entry = module.__dict__.get(_CONSTANTS)
    if entry is not None and entry[0] == key:
        return entry[1], entry[2]
    if capturing():
        return None
    theta, linear_factor = module.theta * 1.0, 1.0  # get_1d_rotary_pos_embed's ntk_factor and linear_factor
    with torch.inference_mode(False), torch.no_grad():
        freqs = torch.cat([
            1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)) / linear_factor
            for dim in module.axes_dim
        ]).repeat_interleave(2)
        axes = torch.cat([torch.full((dim,), axis, dtype=torch.long, device=device)
                          for axis, dim in enumerate(module.axes_dim)])
    module.__dict__[_CONSTANTS] = (key, freqs, axes)
    return freqs, axes


class FastpathFluxPosEmbed(FluxPosEmbed):
    """``FluxPosEmbed`` whose cos/sin tables are built for all axes at once (see module doc). Adds no parameters;
    unpatching gives ``FluxPosEmbed`` back."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (torch.compiler.is_compiling() or ids.dim() != 2 or ids.shape[-1] != len(self.axes_dim)
                or ids.device.type == "npu"
                or maybe_adjust_dtype_for_device(torch.float64, ids.device) is not torch.float64):
            return super().forward(ids)
        constants = _constants(self, ids.device)
        if constants is None:
            return super().forward(ids)
        freqs, axes = constants
        angles = ids.float()[:, axes] * freqs  # each column's axis' float32 positions times its frequency, in float64
        return angles.cos().float(), angles.sin().float()


def patch_pos_embed(module: torch.nn.Module, state: PatchState) -> bool:
    """Swap `module` for `FastpathFluxPosEmbed` if it is exactly diffusers' ``FluxPosEmbed`` of the mirrored
    version; True if it was."""
    if (type(module) is not FluxPosEmbed or not mirrors(FluxPosEmbed.forward, _POS_EMBED_FORWARD)
            or not mirrors(get_1d_rotary_pos_embed, _GET_1D_ROTARY)):
        return False
    state.swap_class(module, FastpathFluxPosEmbed)
    state.set_attr(module, _CONSTANTS, None)
    return True
