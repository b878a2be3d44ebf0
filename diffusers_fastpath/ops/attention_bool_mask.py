"""A boolean attention mask turned into torch's additive mask once per forward instead of once per attention call.

torch's ``scaled_dot_product_attention`` does not read a boolean mask as it is: every call first writes the additive
mask its kernel reads (``aten/src/ATen/native/transformers/attention.cpp``)::

    where(mask.logical_not(), -65504.0, scalar_tensor(0.0, dtype=q.dtype))          # cuDNN's kernel (zero on the host)
    where(mask.logical_not(), -inf, scalar_tensor(0.0, dtype=q.dtype, device=...))  # the memory-efficient one

A model that builds one ``[B, 1, S, S]`` mask per forward and hands it to every block pays that write in every
attention: Ideogram 4's block-diagonal segment mask at 2048x2048 (18432 tokens) is a 680 MB bf16 tensor written and
read 34 times a step, one strided ``where`` kernel of 0.8 ms per block (27 ms of a 1.42 s lossless step on an H100).

Here the processor's call ``dispatch_attention_fn(q, k, v, attn_mask=M, ...)`` hands torch that additive mask, made
by the same expression from the same mask, once per mask tensor and forward (held on the mask by the caller's
``hold``, `_rope_cache.derived`: sealed for the forward that built the mask, dropped with it, computed again after a
write in place): torch then passes it through unchanged (an additive mask is not converted) to the same kernel, which
reads the very values it would have written itself. Which expression is eager's depends on the kernel torch picks
for the call, so the op asks torch (``torch._fused_sdp_choice``, with the boolean mask, as the call would), takes
only cuDNN's and the memory-efficient kernel, and checks once per signature that the additive mask makes torch pick
the same kernel (else that signature runs as written). The first call of each signature also runs the call as
written and compares the two by ``torch.equal`` (`FusedOp`'s self-verification).

The guard takes: diffusers' ``dispatch_attention_fn`` on its native backend (torch's SDPA) without a parallel config,
with only ``attn_mask``, ``backend``, ``parallel_config``, ``dropout_p=0.0``, ``is_causal``, ``scale`` and
``enable_gqa`` passed; a 4-D boolean mask on the operands' device; fp16/bf16 CUDA ``[B, S, H, D]`` operands of one
dtype; no autograd; not under ``torch.compile`` (which traces the call as written). Anything else runs the call as
written.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention import SDPBackend

from ._policy import HALF_DTYPES, FusedOp, Site
from .attention_gqa import native_call_reason
from .attention_seq_major import _backends

_KEYWORDS = frozenset({"attn_mask", "backend", "parallel_config", "dropout_p", "is_causal", "scale", "enable_gqa"})
_TAKEN = (int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION))
_OTHER_KERNEL: set = set()  # signatures whose additive mask made torch pick another kernel: run as written

Hold = Callable[[torch.Tensor, tuple, Callable[[], torch.Tensor]], torch.Tensor]


def additive_mask(mask: torch.Tensor, kind: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask torch's SDPA makes of the boolean `mask` for a call whose kernel is `kind` (the expressions
    of ``convert_boolean_attn_mask_cudnn`` and ``convert_boolean_attn_mask``, as aten writes them).

    cuDNN's zero is made on the mask's device here, where aten makes it on the host: ``where`` moves a 0-dim operand
    to the output's device (``where_self_out``: ``other.to(device)``), a pageable host-to-device copy that a CUDA
    graph capture refuses (Ideogram 4's forward did not capture for it). A zero filled on the device is the same
    operand: the same values come out, and torch takes the same kernel for them."""
    if kind == int(SDPBackend.CUDNN_ATTENTION):
        return torch.where(mask.logical_not(), -65504.0, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))
    return torch.where(mask.logical_not(), -float("inf"), torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def sdpa_choice(q, k, v, mask, kwargs: dict) -> int:
    """The kernel torch's SDPA picks for diffusers' native call on ``[B, S, H, D]`` operands with `mask`."""
    qt, kt, vt = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    return int(torch._fused_sdp_choice(qt, kt, vt, mask, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                                       scale=kwargs.get("scale"), enable_gqa=kwargs.get("enable_gqa", False)))


def _signature(dispatch, q, k, v, hold, arguments: tuple):
    kwargs = dict(arguments)
    mask = kwargs.get("attn_mask")
    scalars = tuple((n, x) for n, x in arguments if n not in ("attn_mask", "backend", "parallel_config"))
    return (str(q.dtype).removeprefix("torch."), str(q.device), tuple(q.shape), q.stride(), tuple(k.shape), k.stride(),
            tuple(v.shape), v.stride(), tuple(mask.shape), mask.stride(), scalars, _backends())


def attention_bool_mask_ref(dispatch, q, k, v, hold, arguments: tuple) -> torch.Tensor:
    """Eager: the processor's call as written (torch converts the boolean mask itself)."""
    return dispatch(q, k, v, **dict(arguments))


def _kernel(dispatch, q, k, v, hold: Hold, arguments: tuple) -> torch.Tensor:
    kwargs = dict(arguments)
    mask = kwargs["attn_mask"]
    kind = SDPA_CHOICE(q, k, v, mask, kwargs)  # (the guard's, asked again: it is not kept between calls)
    additive = hold(mask, ("sdpa_additive_mask", kind, q.dtype), lambda: additive_mask(mask, kind, q.dtype))
    if kind in _TAKEN and SDPA_CHOICE(q, k, v, additive, kwargs) == kind:
        kwargs["attn_mask"] = additive
    else:  # torch would run another kernel on the additive mask: as written (counted fast, the same call as eager's)
        _OTHER_KERNEL.add(_signature(dispatch, q, k, v, hold, arguments))
    return dispatch(q, k, v, **kwargs)


def _guard(dispatch, q, k, v, hold, arguments: tuple, check_pointers: bool = True) -> str | None:
    kwargs = dict(arguments)
    reason = native_call_reason(dispatch, kwargs, _KEYWORDS)
    if reason is not None:
        return reason
    mask = kwargs.get("attn_mask")
    if not (isinstance(mask, torch.Tensor) and mask.dtype is torch.bool and mask.dim() == 4):
        return "not a 4-D boolean mask"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "shape"
    if q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {str(q.dtype).removeprefix('torch.')}"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "requires grad"
    if k.device != q.device or v.device != q.device or mask.device != q.device:
        return "devices differ"
    if _OTHER_KERNEL and _signature(dispatch, q, k, v, hold, arguments) in _OTHER_KERNEL:
        return "the additive mask picks another attention kernel"
    try:
        kind = SDPA_CHOICE(q, k, v, mask, kwargs)
    except Exception:  # noqa: BLE001 - a guard never raises: the call as written says what is wrong
        return "torch's attention kernel choice failed"
    if kind not in _TAKEN:
        return f"attention kernel {SDPBackend(kind).name.lower()}"
    if not q.is_cuda:  # (last: the CPU tests take the rest as on CUDA)
        return f"device {q.device.type}"
    return None


SDPA_CHOICE = sdpa_choice  # what the guard asks torch (tests on a CPU: the memory-efficient kernel's, as on CUDA)

ATTENTION_BOOL_MASK = FusedOp(
    "attention_bool_mask",
    ref=attention_bool_mask_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=None,  # never traced: under torch.compile the call runs as written (the guard)
    verify_key=_signature,
)


def attention_bool_mask(dispatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hold: Hold,
                        site: Site | None = None, **arguments) -> torch.Tensor:
    """``dispatch(q, k, v, **arguments)`` with a boolean ``attn_mask``, handed to torch as the additive mask it would
    make of it, made once per mask tensor and forward where `hold` keeps it; bit-identical to eager (module doc).

    Args:
        dispatch: the attention function the processor calls (diffusers' ``dispatch_attention_fn``).
        q, k, v: ``[B, S, H, D]``.
        hold: ``hold(mask, key, compute)``: ``compute()``, kept for `mask` under `key` where the caller may keep it
            (`_rope_cache.derived` on the mask), else computed now.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        arguments: the processor's keyword arguments (``attn_mask``, ``backend``, ``parallel_config``, ...).
    """
    return ATTENTION_BOOL_MASK(site, dispatch, q, k, v, hold, tuple(sorted(arguments.items(), key=lambda kv: kv[0])))


_SDPA = torch.nn.functional.scaled_dot_product_attention  # torch's own, as imported


def sdpa_capturable(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """torch's ``scaled_dot_product_attention``, with a boolean mask that torch would convert for cuDNN's kernel (its
    zero made on the host, copied to the GPU: refused inside a CUDA graph capture) handed over as that additive mask
    made on the device (`additive_mask`), where torch then picks the same kernel; every other call as made. The
    capture twin of ``torch.nn.functional.scaled_dot_product_attention`` for forwards whose processors call torch with
    boolean masks the fused op does not take (Qwen-Image 2.1's per-segment masks): the same kernel reads the same
    values."""
    if (isinstance(attn_mask, torch.Tensor) and attn_mask.dtype is torch.bool and query.is_cuda
            and attn_mask.device == query.device):
        def choice(mask):
            return int(torch._fused_sdp_choice(query, key, value, mask, dropout_p, is_causal, scale=scale,
                                               enable_gqa=enable_gqa))

        kind = choice(attn_mask)
        if kind == int(SDPBackend.CUDNN_ATTENTION):
            additive = additive_mask(attn_mask, kind, query.dtype)
            if choice(additive) == kind:
                attn_mask = additive
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 enable_gqa=enable_gqa)
