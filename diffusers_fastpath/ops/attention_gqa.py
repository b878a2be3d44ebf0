"""Grouped-query attention on the key and value heads as they are, without the copies that repeat them (Krea 2).

Eager (``Krea2AttnProcessor``; NucleusMoE-Image's processor likewise; ``[B, S, H, D]`` operands, ``H = groups *
Hkv``)::

    if num_key_value_groups > 1:
        key = key.repeat_interleave(num_key_value_groups, dim=2)       # [B, S, Hkv, D] -> [B, S, H, D]: a copy
        value = value.repeat_interleave(num_key_value_groups, dim=2)
    hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=..., parallel_config=...)

Here the same call with ``enable_gqa=True`` on the ``Hkv`` heads: diffusers' native backend hands it to torch's
``scaled_dot_product_attention``, whose kernels read key/value head ``h // groups`` for query head ``h``, the head
``repeat_interleave`` would have copied there. Two copies of 4 x the key and value bytes per attention go (Krea 2 at
1024x1024: 57 copies, 4.0 ms of a 225 ms lossless step on an H100). Whether torch picks a kernel that computes the
same values from the grouped operands is a property of the kernel it picks (on an H100 with torch 2.11, cuDNN's
flash kernel at Krea 2's shapes, with its padding mask and without: the same kernel, bit-identical,
``.whl/s31_gqa_probe.py`` in session 31's log), so the op verifies itself: the first call of each signature (dtype,
device, shapes, the mask's shape and dtype, torch's SDPA settings) also runs the eager way and compares the two by
``torch.equal``; a mismatch disables the op for the process with one warning and that call returns eager's result.

The guard takes: diffusers' ``dispatch_attention_fn`` (the function the processor calls, checked to be the one
diffusers defines), whose backend resolves to diffusers' native one (``backend`` None and no other active, or named
native) without a parallel config, with only ``attn_mask``, ``backend``, ``parallel_config``, ``dropout_p=0.0``
and ``is_causal=False`` passed, and a diffusers that passes ``enable_gqa`` on (torch >= 2.5); fp16/bf16 CUDA
``[B, Sq, H, D]`` query and ``[B, S, Hkv, D]`` key and value of one dtype and device, ``H`` the groups times ``Hkv``
(NucleusMoE-Image's image queries against its joint keys: the same form); no autograd; not under ``torch.compile`` (which traces
the copies as written). Anything else runs the two copies and the call as written.
"""

from __future__ import annotations

import torch

from ._policy import HALF_DTYPES, FusedOp, Site
from .attention_seq_major import _backends

_KEYWORDS = frozenset({"attn_mask", "backend", "parallel_config", "dropout_p", "is_causal"})


def _dispatch_module():
    from diffusers.models import attention_dispatch

    return attention_dispatch


def attention_gqa_ref(dispatch, q, k, v, groups: int, arguments: tuple) -> torch.Tensor:
    """Eager: the key and value heads repeated, then the processor's call."""
    return dispatch(q, k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2), **dict(arguments))


def _kernel(dispatch, q, k, v, groups: int, arguments: tuple) -> torch.Tensor:
    return dispatch(q, k, v, enable_gqa=True, **dict(arguments))


def _native(module, backend) -> bool:
    """Whether a call with `backend` runs diffusers' native attention (torch's SDPA)."""
    names = module.AttentionBackendName
    if backend is None:
        backend = module._AttentionBackendRegistry.get_active_backend()[0]
    return backend == names.NATIVE or (isinstance(backend, str) and backend == names.NATIVE.value)


def native_call_reason(dispatch, kwargs: dict, keywords: frozenset) -> str | None:
    """Why ``dispatch(q, k, v, **kwargs)`` is not diffusers' ``dispatch_attention_fn`` on its native backend (torch's
    SDPA) with only `keywords` passed, no parallel config and no dropout, or ``None`` (the attention ops' shared
    part of their guards)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    module = _dispatch_module()
    if dispatch is not module.dispatch_attention_fn:
        return "attention is not diffusers' dispatch_attention_fn"
    if (not set(kwargs) <= keywords or kwargs.get("parallel_config") is not None
            or kwargs.get("dropout_p", 0.0) != 0.0):
        return "arguments"
    if not _native(module, kwargs.get("backend")):
        return "attention backend not native"
    return None


def _guard(dispatch, q, k, v, groups, arguments: tuple, check_pointers: bool = True) -> str | None:
    kwargs = dict(arguments)
    reason = native_call_reason(dispatch, kwargs, _KEYWORDS)
    if reason is not None:
        return reason
    if not getattr(_dispatch_module(), "_CAN_USE_FLEX_ATTN", False):  # (a diffusers that passes enable_gqa on)
        return "attention is not diffusers' dispatch_attention_fn"
    if kwargs.get("is_causal", False) is not False:
        return "arguments"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "shape"
    if type(groups) is not int or groups < 2 or k.shape != v.shape or q.shape[2] != groups * k.shape[2]:
        return "shape"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:  # (the queries' tokens may be fewer: NucleusMoE's)
        return "shape"
    if q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {str(q.dtype).removeprefix('torch.')}"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "requires grad"
    if not q.is_cuda:
        return f"device {q.device.type}"
    if k.device != q.device or v.device != q.device:
        return "devices differ"
    return None


def _signature(dispatch, q, k, v, groups, arguments: tuple):
    mask = dict(arguments).get("attn_mask")
    mask = None if mask is None else (tuple(mask.shape), str(mask.dtype)) if isinstance(mask, torch.Tensor) else "other"
    return (str(q.dtype).removeprefix("torch."), str(q.device), tuple(q.shape), tuple(k.shape), mask, _backends())


ATTENTION_GQA = FusedOp(
    "attention_gqa",
    ref=attention_gqa_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=None,  # never traced: under torch.compile the copies run as written (the guard)
    verify_key=_signature,
)


def attention_gqa(dispatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, site: Site | None = None,
                  **arguments) -> torch.Tensor:
    """``dispatch(q, k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2), **arguments)``, where
    verified without the copies (``enable_gqa=True``), bit-identical to eager either way (module doc).

    Args:
        dispatch: the attention function the processor calls (diffusers' ``dispatch_attention_fn``).
        q: ``[B, S, H, D]`` queries; k, v: ``[B, S, Hkv, D]``, ``H = groups * Hkv``.
        groups: the query heads per key/value head.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        arguments: the processor's keyword arguments (``attn_mask``, ``backend``, ``parallel_config``).
    """
    return ATTENTION_GQA(site, dispatch, q, k, v, groups, tuple(sorted(arguments.items(), key=lambda kv: kv[0])))
