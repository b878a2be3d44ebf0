"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``) under CUDA graphs. Its blocks are patched by the generic path
(`generic`); this module holds only what its forward needs to be captured.

Its forward lays the joint sequence out from the values of ``img_mask`` (the vision-language encoder's image slots):
``repeat_interleave`` of the slots by a tensor of repeats, boolean-mask scatters and gathers, ``nonzero`` positions,
the rotary embedder's ``image_pad_mask.tolist()`` and index tables from Python lists, ``int((~target_token_mask)
.sum())`` and the prefix segments' ``.tolist()``; every one waits for the GPU or copies from the host, so no capture
of it could be made ("operation not permitted when stream is capturing"). Each of those values follows from
``img_mask`` and ``img_shapes`` alone (a plain argument, already in every graph's signature), as diffusers 0.42.1
writes the module. So ``img_mask``'s values are the model's host key (`graphs.register_host_key`: read from a host
copy before every call; a graph recorded for one slot layout is never replayed for another), and while a signature
records, the data-dependent calls made by the module's code are answered from its warm-up
(`diffusers_fastpath._host_ops`, `graphs.register_host_ops`). The module's source must be the one read for that
(`_MODULE`, a digest of its text); any other runs as before (no capture, eager, the reason in `report`). Its
processor attends per prefix segment with boolean masks that torch converts itself; for cuDNN's kernel that
conversion copies a host zero to the GPU, so while it records, torch's ``scaled_dot_product_attention`` is bound to
`ops.attention_bool_mask.sdpa_capturable` (the same additive mask, its zero made on the device).

Not captured: the pipeline's KV-cached steps (``kv_cache``, an object the graph signature does not take: eager, with
the reason); a ``QwenImage21FlexAttnProcessor`` (its block mask is not among the calls answered: the capture fails
and that signature runs eager).
"""

from __future__ import annotations

import hashlib
import inspect

import torch
from diffusers.models.transformers import transformer_qwenimage21
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

from .. import graphs
from ..ops.attention_bool_mask import sdpa_capturable

# sha256[:16] of diffusers 0.42.1's transformer_qwenimage21 module source, read for the claim above
_MODULE = "7a3393f89b1eb71d"
_FILE = "transformer_qwenimage21.py"  # (diffusers' file, and the rewritten copies' names, which hold it)


def _module_digest() -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(transformer_qwenimage21).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def image_slots(model: QwenImage21Transformer2DModel, call: dict):
    """The host key of a Qwen-Image 2.1 forward (`graphs.HOST_KEYS`): the values of ``img_mask``, read on the host."""
    mask = call.get("img_mask")
    if not (isinstance(mask, torch.Tensor) and mask.dtype is torch.bool):
        return None, None
    host = mask.to("cpu")  # waits for the GPU, as the eager forward's first data-dependent call does
    return ("img_mask", tuple(host.shape), host.numpy().tobytes()), None


if _module_digest() == _MODULE:
    graphs.register_host_key(QwenImage21Transformer2DModel, image_slots)
    graphs.register_host_ops(QwenImage21Transformer2DModel, (_FILE,))
graphs.register_capture_twin(QwenImage21Transformer2DModel, torch.nn.functional, "scaled_dot_product_attention",
                             sdpa_capturable)
