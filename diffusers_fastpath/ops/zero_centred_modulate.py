"""Krea 2's zero-centred float32 RMSNorm and the adaLN modulate that reads it, in one pass, bit-identical to eager.

``Krea2TransformerBlock.forward`` and ``Krea2FinalLayer.forward`` write, T the activations' dtype (bf16 or fp16)::

    modulation = temb.unflatten(-1, (6, -1)) + self.scale_shift_table       # T: the table is not kept in fp32
    prescale, preshift, ... = modulation.unbind(-2)                          # [B, 1, D] views of [B, 1, 6, D]
    self.attn((1.0 + prescale) * self.norm1(hidden_states) + preshift, ...)  # likewise norm2, and the final layer's
                                                                             # (1.0 + scale) * self.norm(x) + shift

with ``self.norm1`` a ``Krea2RMSNorm`` (`zero_centred_rmsnorm`: ``F.rms_norm(x.float(), (D,), weight=self.weight +
1.0, eps).to(T)``). The rounding points::

    y   = round_T(w * (rstd * x))                   # the norm, w = weight + 1.0 in float32, cast back to T
    a   = round_T(1 + scale)                        # the forward's own add: [B, 1, D], rounded to T
    out = round_T(round_T(a * y) + shift)           # two eager kernels, each rounding to T

(``_keep_in_fp32_modules`` of Krea 2 names the norms, not the blocks' ``scale_shift_table``: loaded in bf16 the whole
modulate is in T. Rows of another dtype, a float32 table, make eager's modulate a float32 one with a float32 result:
the guard refuses them and the chain runs as written.) Eager runs the norm's four kernels and the modulate's three
(the last two over the whole ``[B, S, D]`` activation), writing and reading the normalised rows once more; the kernel
is ``csrc/rotary.cu``'s row norm (`zero_centred_rmsnorm`'s, ``row_norm_rotary_kernel``) in its ``kNoRotaryModulate``
form: x read once, the modulated rows written once, the normalised rows never stored. The norm sums in aten's order,
a property of the aten build, so the op verifies itself: the first fast call of each (dtype, D) is compared with
eager by ``torch.equal``; a mismatch disables it for the process with one warning and the chain runs as written.

What the guard admits: what `zero_centred_rmsnorm`'s guard admits for the norm (a module of a class registered with
``add_norm_class``, whose forward was proven by source digest to be the zero-centred norm, its forward not replaced
since; a float32 ``[D]`` weight, a python float eps; contiguous bf16/fp16 x, D a multiple of 4 up to 8192, 8-byte
aligned, no autograd, on CUDA), x three-dimensional ``[B, S, D]`` with B at most 65535, and scale and shift tensors of
x's dtype and device of shape ``[B or 1, 1, D]``, unit innermost stride, rows 8-byte aligned. A norm with hooks (its
own, a forward replaced on the instance or the class, global ones) refuses before the guard: the fallback calls the
module, so they run, then the exact modulate (`modulate_scale_shift`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .modulate_scale_shift import modulate_scale_shift
from .qk_norm_rope import ROW_NORM_FINAL
from .rmsnorm_scale_shift import NOT_A_TENSOR
from .zero_centred_rmsnorm import _guard as _norm_guard
from .zero_centred_rmsnorm import nvrtc_zero_centred, raw_reason, zero_centred_rmsnorm_ref


def zero_centred_modulate_ref(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor,
                              shift: torch.Tensor) -> torch.Tensor:
    """The eager chain as Krea 2 writes it, the norm being its diffusers class's forward (what the kernel is checked
    against)."""
    return (1.0 + scale) * zero_centred_rmsnorm_ref(norm, x) + shift


def zero_centred_modulate_arithmetic(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                     eps: float) -> torch.Tensor:
    """The kernel's computation from the tensors (`weight` the forward's ``weight + 1.0``, `scale` and `shift` ``[B or
    1, D]`` rows): the custom op's CPU path, the tests' emulated kernel."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), weight=weight, eps=eps).to(x.dtype)
    return (1.0 + scale[:, None]) * normed + shift[:, None]


def _fallback(norm, x, scale, shift):
    """The norm module's call (its hooks run), then the modulate as `modulate_scale_shift` (exact on any input: its
    ``[B, D]`` rows are the same elements)."""
    normed = norm(x)
    if (all(isinstance(t, torch.Tensor) for t in (normed, scale, shift)) and scale.dim() == shift.dim() == 3
            and scale.shape[1] == shift.shape[1] == 1):
        return modulate_scale_shift(normed, scale.squeeze(1), shift.squeeze(1))
    return (1.0 + scale) * normed + shift


def _rows_reason(t, x: torch.Tensor, check_pointers: bool) -> str | None:
    """Why `t` is not a ``[B or 1, 1, D]`` row tensor of x's the kernel reads, or ``None``."""
    if not isinstance(t, torch.Tensor):
        return NOT_A_TENSOR
    if t.dtype is not x.dtype:
        return "rows not of x's dtype"  # (a float32 table: eager's modulate is a float32 one)
    if t.dim() != 3 or t.shape[1] != 1 or t.shape[2] != x.shape[2] or t.shape[0] not in (1, x.shape[0]):
        return "rows not [B or 1, 1, D]"
    if t.stride(2) != 1 or t.stride(0) % 4:  # (bindings_rotary.cpp checks the batch stride of one row too)
        return "rows strided"
    if t.device != x.device:
        return "devices differ"
    if t.requires_grad and torch.is_grad_enabled():
        return "requires grad"
    if check_pointers and t.data_ptr() % 8:
        return "not 8-byte aligned"
    return None


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] > 65535:
        return "x not [B, S, D] with B <= 65535"
    reason = _rows_reason(scale, x, check_pointers) or _rows_reason(shift, x, check_pointers)
    return reason if reason is not None else _norm_guard(norm, x, check_pointers)  # (its device check last)


# The NVRTC way: zero_centred_rmsnorm's launcher with the rows (bindings_rotary.cpp's zero_centred_modulate); the guard
# stands for its checks.
def _nvrtc_kernel(x, weight, scale, shift, eps: float, norm_final: int) -> torch.Tensor:
    return nvrtc_zero_centred(x, weight, eps, norm_final, scale, shift)


def _raw_guard(x, weight, scale, shift, eps, norm_final):
    reason = raw_reason(x, weight, norm_final, dims=3)
    if reason is not None:
        return reason
    for t in (scale, shift):
        if not (t.dim() == 2 and t.shape[0] in (1, x.shape[0]) and t.shape[1] == x.shape[2] and t.stride(1) == 1
                and t.stride(0) % 4 == 0 and t.dtype is x.dtype and t.device == x.device and t.data_ptr() % 8 == 0):
            return "scale or shift"
    return None


_nvrtc.raw_op("_zero_centred_modulate_cuda",
              "(Tensor x, Tensor weight, Tensor scale, Tensor shift, float eps, int norm_final) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_zero_centred_modulate_cuda")  # (x, weight + 1, scale, shift, eps, final)


def _fused(x, weight, scale, shift, eps: float) -> torch.Tensor:
    """The kernel, with the forward's own float32 add ``weight + 1.0`` made first; the rows as ``[B or 1, D]``."""
    return _launch(x, weight + 1.0, scale.squeeze(1), shift.squeeze(1), eps, ROW_NORM_FINAL)


def _kernel(norm, x, scale, shift):
    return _fused(x, norm.weight, scale, shift, norm.eps)


@torch.library.custom_op("diffusers_fastpath::zero_centred_modulate", mutates_args=())
def _zero_centred_modulate_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                              eps: float) -> torch.Tensor:
    # What torch.compile runs: the kernel on CUDA (the caller's guard admitted these inputs; torch.compile emits this
    # op only for signatures already verified, see FusedOp), the arithmetic elsewhere.
    if x.is_cuda:
        return _fused(x, weight, scale, shift, eps)
    return zero_centred_modulate_arithmetic(x, weight + 1.0, scale.squeeze(1), shift.squeeze(1), eps).contiguous()


@_zero_centred_modulate_op.register_fake
def _(x, weight, scale, shift, eps):
    torch._check(x.dim() == 3, lambda: "zero_centred_modulate: x must be three-dimensional")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


ZERO_CENTRED_MODULATE = FusedOp(
    "zero_centred_modulate",
    ref=zero_centred_modulate_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.zero_centred_modulate.default(
        x, norm.weight, scale, shift, norm.eps),
    verify_key=lambda norm, x, *rows: (str(x.dtype).removeprefix("torch."), x.shape[-1], "zero-centred norm modulate"),
    fallback=_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def zero_centred_modulate(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                          site: Site | None = None) -> torch.Tensor:
    """``(1.0 + scale) * norm(x) + shift`` for Krea 2's zero-centred float32 RMSNorm ``norm``, in one pass on CUDA
    (self-verified), bit-identical to eager everywhere.

    Args:
        norm: the norm module (of a class registered by ``zero_centred_rmsnorm.add_norm_class``: `patch` swaps
            Krea 2's norms for one); ``weight`` float32 ``[D]`` (the scale is ``1 + weight``), ``eps``. Called as a
            module where the kernel refuses (its hooks run).
        x: ``[B, S, D]`` bf16/fp16 activations, contiguous.
        scale, shift: ``[B or 1, 1, D]`` rows of x's dtype (Krea 2's ``modulation.unbind(-2)`` views).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm
        >>> from diffusers_fastpath.ops import zero_centred_modulate, zero_centred_modulate_ref
        >>> norm, x, rows = Krea2RMSNorm(64), torch.randn(2, 8, 64).bfloat16(), torch.randn(2, 2, 1, 64).bfloat16()
        >>> torch.equal(zero_centred_modulate(norm, x, *rows), zero_centred_modulate_ref(norm, x, *rows))
        True
    """
    return ZERO_CENTRED_MODULATE(site, norm, x, scale, shift)
