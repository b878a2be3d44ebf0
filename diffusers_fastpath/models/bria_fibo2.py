"""Bria FIBO 2 (``BriaFibo2Transformer2DModel``) under CUDA graphs. Its blocks are patched by the generic path
(`generic`); this module holds only what its forward needs to be captured.

Every forward reads its text lengths on the host, ``encoder_attention_mask.sum(dim=1).tolist()``, and derives from
them the number of gist tokens (`compute_gist_count`: the Perceiver's output length, the sequence layout, the gist
padding mask), so no capture of it could be made. So the lengths are the model's host key
(`diffusers_fastpath.graphs.register_host_key`: read from a host copy of the mask before each call, part of the
graph's signature, so a graph recorded for some lengths is never replayed for others), and while a signature records
the forward's ``.tolist()`` is answered with them (`diffusers_fastpath._host_reads`: checked against the device's
own read in the warm-up, never touching the device in the capture). Its ``torch.tensor(gist_counts, device=...)`` is
built inside the capture by `_host_constants`, and its boolean key-padding masks go to torch as the additive mask
made on the device (`_chain_calls.attention_bool_mask` while a graph records).

The key is taken only for a boolean or integer 2-D mask (whose sums are exact, on the host as on the device), and only
where the installed forward reads its lengths by that very expression once and makes no other ``.tolist()`` or
``.item()`` read; any other mask runs eager, with the reason counted in `report`. A mask of None reads nothing: its
key is empty.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2Transformer2DModel

from .._host_reads import HostReads, register_tolist_reads
from .._source import source_of

_READ = "encoder_attention_mask.sum(dim=1).tolist()"


def _reads_only_text_lengths(forward) -> bool:
    """Whether `forward`'s installed source reads the host by ``_READ`` once and in no other ``.tolist()`` /
    ``.item()``."""
    source, _ = source_of(forward)
    return source is not None and source.count(_READ) == 1 and source.count(".tolist(") == 1 and ".item(" not in source


def text_lengths(model: BriaFibo2Transformer2DModel, call: dict):
    """The host key of a Bria FIBO 2 forward (`graphs.HOST_KEYS`): the per-prompt text lengths it reads, and for a
    recording the `HostReads` that answer its ``.tolist()`` with them."""
    mask = call.get("encoder_attention_mask")
    if mask is None:
        return (), lambda: HostReads([])
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2
            and (mask.dtype is torch.bool or not (mask.dtype.is_floating_point or mask.dtype.is_complex))):
        return None, None
    lengths = mask.to("cpu").sum(dim=1).tolist()  # waits for the GPU, as the eager forward's .tolist() does
    return ("text lengths", tuple(lengths)), lambda: HostReads([lengths])


if _reads_only_text_lengths(BriaFibo2Transformer2DModel.forward):
    register_tolist_reads(BriaFibo2Transformer2DModel, text_lengths)
