"""The adaLN LayerNorm + modulate forms FLUX.1's `layernorm_scale_shift` does not take, on its kernel:
``norm(x) * (1 + scale) + shift`` with ``[B or 1, S or 1, D]`` scale/shift rows of x's dtype, bit-identical to eager:

- **per-token rows** ``[B, S, D]``: FLUX.3's blocks modulate with per-token chunks of a per-token modulation
  (``(1 + mod_scale) * self.norm(x) + mod_shift``, ``mod_scale`` a ``[B, S, D]`` view of a ``[B, S, 3D]`` linear
  output); the LayerNorm statistics and the rounding points are `layernorm_scale_shift`'s, only the rows' addressing
  (a seq stride besides the batch stride) differs. ``[B, 1, D]`` rows are one row per sample, as there.
- **a norm with its own affine**: ``nn.LayerNorm(elementwise_affine=True)`` with weight and bias of x's dtype
  (CogVideoX's and ConsisID's ``norm_out``, EasyAnimate's): aten's ``vectorized_layer_norm_kernel`` computes
  ``gamma * (rstd * (x - mean)) + beta`` in fp32 and rounds to T once; its build contracts the multiply-add into one
  FMA (the epilogue `layernorm_affine_fp32` reproduces for Wan's norm2, confirmed on the H200 for aten's fp32
  instantiation). The kernel computes ``round_T(fma(float(weight), normed, float(bias)))`` and then the modulate's
  three rounding points.
- **diffusers' FP32LayerNorm** (AuraFlow's ``norm1.norm`` and ``norm2``, without affine; EasyAnimate's, with):
  ``F.layer_norm(x.float(), ..., weight.float(), bias.float()).to(x.dtype)``: aten's fp32 instantiation of the same
  kernel over the same floats (the statistics `layernorm_scale_shift_fp32` relies on for Wan), its fp32 output cast
  back: one rounding of the same fp32 value, so the same ``y`` as above.

Which FMA aten's build contracts, and that its fp32 and T instantiations reduce alike, are properties of the platform,
so the op verifies itself as `layernorm_scale_shift` does: the first fast call of each signature (dtype, D, the norm's
kind and affine, per-token rows or not) is compared with eager by ``torch.equal``; a mismatch disables the op for the
process with one warning and that call returns the eager result. The reference, for that check and every fallback,
is the norm module called as the model calls it (its hooks run), then the eager modulate.

Guard (the reason is counted on the site; the eager expression runs): x ``[B, S, D]`` contiguous, fp16/bf16, D a
multiple of 8 and at most 6144; scale/shift of x's dtype with unit innermost stride and rows 16-byte aligned (batch
and seq strides multiples of 8 elements); the norm exactly ``nn.LayerNorm`` or ``FP32LayerNorm`` over the last dim,
weight and bias both or neither (a LayerNorm's of x's dtype, contiguous and 16-byte aligned: aten's vectorized path
needs gamma and beta aligned to 4 elements, else it reduces otherwise); no autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .layernorm_scale_shift import _cuda_ops, _guard_tensors, _nvrtc_kernel
from .selected_rows import SelectedRows, table_rows_aligned

_VEC_BYTES = 16
_NORMS = (nn.LayerNorm, FP32LayerNorm)


def name_site(site: Site | None, op: str) -> None:
    """Name `site` after the op its call runs now (`report` shows it): a LayerNorm + modulate site is added as
    `layernorm_scale_shift` or `layernorm_modulate` by its norm's kind, and its calls may run either or
    `layernorm_scale` (per-token rows, a scale without a shift); the name is that of its latest call."""
    if site is not None and site.op != op:
        site.op = op


def layernorm_modulate_ref(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The eager chain: ``norm(x) * (1 + scale) + shift`` (the norm module itself, then three kernels)."""
    return norm(x) * (1 + scale) + shift


def _fp32(norm) -> bool:
    return type(norm) is FP32LayerNorm


def _norm_unfit(norm, x, check_pointers: bool) -> str | None:
    """Why `norm` is not a LayerNorm the kernel reproduces over x's last dim, or None."""
    if type(norm) not in _NORMS or x.dim() == 0 or tuple(norm.normalized_shape) != (x.shape[-1],):
        return "norm not a LayerNorm over the last dim"
    weight, bias = norm.weight, norm.bias
    if (weight is None) != (bias is None):
        return "norm with a weight or a bias alone"
    if weight is None:
        return None
    if not (_fp32(norm) or weight.dtype is x.dtype and bias.dtype is x.dtype):
        return "norm weight of another dtype"
    if not (weight.is_floating_point() and bias.is_floating_point() and weight.is_contiguous()
            and bias.is_contiguous()):
        return "norm weight strided"
    if weight.device != x.device or bias.device != x.device:
        return "devices differ"
    if torch.is_grad_enabled() and (weight.requires_grad or bias.requires_grad):
        return "requires grad"
    if check_pointers and (weight.data_ptr() % _VEC_BYTES or bias.data_ptr() % _VEC_BYTES):
        return "norm weight not 16-byte aligned"
    return None


def _tensors_guard(x, scale, shift, check_pointers: bool = True) -> str | None:
    """The layout checks of x and the ``[B or 1, S or 1, D]`` rows (bindings_norms.cpp's layernorm_modulate checks):
    those of `layernorm_scale_shift` on each sample's first row, and the seq dim's."""
    if not (isinstance(x, torch.Tensor) and isinstance(scale, torch.Tensor) and isinstance(shift, torch.Tensor)):
        return "operand not a tensor"  # a Python scalar scale or shift: eager broadcasts it
    if x.dim() != 3 or scale.dim() != 3 or shift.dim() != 3:
        return "shape"
    if x.numel() == 0 or scale.numel() == 0 or shift.numel() == 0:
        return "empty"
    reason = _guard_tensors(x, scale[:, 0], shift[:, 0], check_pointers, x.dtype)
    if reason is not None:
        return reason
    vec = _VEC_BYTES // x.element_size()
    if any(t.shape[1] not in (1, x.shape[1]) or (t.shape[1] != 1 and t.stride(1) % vec) for t in (scale, shift)):
        return "scale/shift seq dim"  # not one row per sample or per token, or rows not 16-byte aligned
    return None


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return _norm_unfit(norm, x, check_pointers) or _tensors_guard(x, scale, shift, check_pointers)


def _affine_rows(norm):
    """The norm's weight and bias as the kernel reads them: fp32 ``[D]`` rows (aten's ``static_cast<T_ACC>`` of a
    LayerNorm's, FP32LayerNorm's ``.float()``: the same values), or ``(None, None)``."""
    if norm.weight is None:
        return None, None
    return norm.weight.float(), norm.bias.float()


def _nvrtc_modulate(x, scale, shift, weight, bias, eps: float) -> torch.Tensor:
    # shift None: the scale-only modulate (a null shift pointer)
    strides = tuple(0 if t is None or t.shape[1] == 1 else t.stride(1) for t in (scale, shift))
    return _nvrtc_kernel(x, scale[:, 0], None if shift is None else shift[:, 0], eps, seq_strides=strides,
                         norm_weight=weight, norm_bias=bias)


def _raw_guard(x, scale, shift, weight, bias, eps):
    if (weight is None) != (bias is None):
        return "weight and bias, both or neither"
    for t in () if weight is None else (weight, bias):
        if t.dtype is not torch.float32 or t.shape != (x.shape[-1],) or not t.is_contiguous() or t.data_ptr() % 16:
            return "weight and bias must be contiguous, 16-byte aligned float32 [dim] rows"
    return _tensors_guard(x, scale, scale if shift is None else shift)


_nvrtc.raw_op("_layernorm_modulate_cuda",
              "(Tensor x, Tensor scale, Tensor? shift, Tensor? weight, Tensor? bias, float eps) -> Tensor",
              _raw_guard, _nvrtc_modulate)

_launch = LazyLauncher(_nvrtc_modulate, "_layernorm_modulate_cuda")


def _kernel(norm, x, scale, shift):
    return _launch(x, scale, shift, *_affine_rows(norm), norm.eps)


@torch.library.custom_op("diffusers_fastpath::layernorm_modulate", mutates_args=())
def _layernorm_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, weight: torch.Tensor | None,
                           bias: torch.Tensor | None, eps: float, fp32: bool) -> torch.Tensor:
    # What torch.compile runs: the kernel where the guard (with real pointers) allows, the eager chain elsewhere
    # (weight and bias as the module passes them to F.layer_norm; fp32: FP32LayerNorm's upcast and cast back).
    rows = (None, None) if weight is None else (weight.float(), bias.float())
    aligned = weight is None or fp32 or (weight.data_ptr() % _VEC_BYTES == 0 and bias.data_ptr() % _VEC_BYTES == 0)
    if aligned and _raw_guard(x, scale, shift, *rows, eps) is None:
        return _cuda_ops()._layernorm_modulate_cuda.default(x, scale, shift, *rows, eps)
    y = F.layer_norm(x.float() if fp32 else x, (x.shape[-1],), *(rows if fp32 else (weight, bias)), eps).to(x.dtype)
    return (y * (1 + scale) if shift is None else y * (1 + scale) + shift).contiguous()


@_layernorm_modulate_op.register_fake
def _(x, scale, shift, weight, bias, eps, fp32):
    torch._check(x.dim() == 3, lambda: f"layernorm_modulate: x must be [B, S, D], got {tuple(x.shape)}")
    torch._check(scale.dim() == 3 and (shift is None or shift.dim() == 3),
                 lambda: "layernorm_modulate: scale/shift must be [B, S, D]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _norm_signature(norm, x):
    # what one torch.equal check vouches for: the aten instantiation (T or fp32), its epilogue, the row length ...
    return str(x.dtype).removeprefix("torch."), x.shape[-1], type(norm).__name__, norm.weight is not None


def _signature(norm, x, scale, shift):
    # ... and the rows' addressing
    return (*_norm_signature(norm, x), "per-token" if scale.shape[1] != 1 or shift.shape[1] != 1 else "per-sample")


LAYERNORM_MODULATE = FusedOp(
    "layernorm_modulate",
    ref=layernorm_modulate_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.layernorm_modulate.default(
        x, scale, shift, norm.weight, norm.bias, norm.eps, _fp32(norm)
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def layernorm_modulate(norm, x, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift``, LayerNorm and modulate fused and bit-identical to eager, for per-token rows
    and for norms with their own affine or of diffusers' ``FP32LayerNorm`` (module doc).

    Args:
        norm: ``torch.nn.LayerNorm`` (with or without weight and bias) or diffusers ``FP32LayerNorm``; its ``eps``,
            weight and bias are used, and it runs itself on fallback.
        x: ``[B, S, D]`` activations.
        scale, shift: ``[B or 1, S or 1, D]`` modulation rows of x's dtype (FLUX.3's per-token chunks, or a
            per-sample ``[B, 1, D]`` row).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import layernorm_modulate, layernorm_modulate_ref
        >>> norm = torch.nn.LayerNorm(64, eps=1e-6)
        >>> x, mod = torch.randn(1, 16, 64), torch.randn(1, 16, 3 * 64)
        >>> shift, scale, gate = mod.chunk(3, dim=-1)
        >>> torch.equal(layernorm_modulate(norm, x, scale, shift), layernorm_modulate_ref(norm, x, scale, shift))
        True
    """
    name_site(site, LAYERNORM_MODULATE.name)
    return LAYERNORM_MODULATE(site, norm, x, scale, shift)


# --- the scale-only modulate: Qwen-Image 2.1's ``norm(x) * (1 + scale)`` -------------------------------------------


def layernorm_scale_ref(norm, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The eager chain: ``norm(x) * (1 + scale)`` (the norm module itself, then two kernels)."""
    return norm(x) * (1 + scale)


def _scale_guard(norm, x, scale, check_pointers: bool = True) -> str | None:
    return _guard(norm, x, scale, scale, check_pointers)  # the scale stands for the shift's checks: there is none


def _scale_kernel(norm, x, scale):
    return _launch(x, scale, None, *_affine_rows(norm), norm.eps)  # (the same kernel, no shift)


def _scale_signature(norm, x, scale):
    return (*_signature(norm, x, scale, scale), "scale only")


LAYERNORM_SCALE = FusedOp(
    "layernorm_scale",
    ref=layernorm_scale_ref,
    guard=_scale_guard,
    kernel=_scale_kernel,
    custom_op=lambda norm, x, scale: torch.ops.diffusers_fastpath.layernorm_modulate.default(
        x, scale, None, norm.weight, norm.bias, norm.eps, _fp32(norm)
    ),
    verify_key=_scale_signature,
    modules=(0,),
)


def layernorm_scale(norm, x, scale, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1 + scale)``: `layernorm_modulate` without a shift (Qwen-Image 2.1's blocks: per-token rows that
    ``torch.where`` picks between each sample's and the ``t = 0`` row), the product rounded once to x's dtype as
    eager's, with no addition after it; the same guard and self-verification (its own signatures).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import layernorm_scale, layernorm_scale_ref
        >>> norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        >>> x, scale = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
        >>> torch.equal(layernorm_scale(norm, x, scale), layernorm_scale_ref(norm, x, scale))
        True
    """
    name_site(site, LAYERNORM_SCALE.name)
    return LAYERNORM_SCALE(site, norm, x, scale)


# --- indexed scale rows: Qwen-Image 2.1's where-picked rows (ops/selected_rows.py), read through an index -----------


def layernorm_scale_rows_ref(norm, x: torch.Tensor, rows: SelectedRows) -> torch.Tensor:
    """The eager chain: ``norm(x) * (1 + rows)`` with the rows as the model computes them."""
    return norm(x) * (1 + rows.materialize())


def _rows_guard(norm, x, rows, check_pointers: bool = True) -> str | None:
    if not isinstance(rows, SelectedRows):
        return "operand not a tensor"
    reason = _norm_unfit(norm, x, check_pointers) or rows.reason(x)
    if reason is not None:
        return reason
    table = rows.params
    return _guard_tensors(x, table[:1], table[:1], check_pointers, x.dtype) or (
        None if table_rows_aligned(table) else "scale/shift strided")


def _nvrtc_modulate_rows(x, scale, shift, index, weight, bias, eps: float) -> torch.Tensor:
    strides = tuple(0 if t is None or t.shape[0] == 1 else t.stride(0) for t in (scale, shift))
    return _nvrtc_kernel(x, scale[:1], None if shift is None else shift[:1], eps, seq_strides=strides,
                         norm_weight=weight, norm_bias=bias, row_index=index)


def _raw_rows_guard(x, scale, shift, index, weight, bias, eps):
    """bindings_norms.cpp's layernorm_modulate_rows checks ([rows, dim] tables; the index's values are the caller's)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "shape"
    if not (isinstance(index, torch.Tensor) and index.dtype is torch.int32 and index.is_contiguous()
            and index.shape == x.shape[:2] and index.device == x.device):
        return "index must be a contiguous int32 [batch, seq] tensor on x's device"
    for t in (scale,) if shift is None else (scale, shift):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not table_rows_aligned(t):
            return "scale/shift must be [rows, dim] tables with 16-byte aligned rows"
    return _raw_guard(x, scale[None, :1], None if shift is None else shift[None, :1], weight, bias, eps)


_nvrtc.raw_op("_layernorm_modulate_rows_cuda",
              "(Tensor x, Tensor scale, Tensor? shift, Tensor index, Tensor? weight, Tensor? bias, float eps) -> Tensor",
              _raw_rows_guard, _nvrtc_modulate_rows)

_launch_rows = LazyLauncher(_nvrtc_modulate_rows, "_layernorm_modulate_rows_cuda")


def _rows_kernel(norm, x, rows):
    return _launch_rows(x, rows.table(), None, rows.index(), *_affine_rows(norm), norm.eps)


def _rows_signature(norm, x, rows):
    return (*_norm_signature(norm, x), "indexed rows", "scale only")


LAYERNORM_SCALE_ROWS = FusedOp(
    "layernorm_scale_rows",
    ref=layernorm_scale_rows_ref,
    guard=_rows_guard,
    kernel=_rows_kernel,
    # torch.compile: the rows written out, then the registered layernorm_modulate (no SelectedRows is made while
    # compiling; this is for a caller that does)
    custom_op=lambda norm, x, rows: torch.ops.diffusers_fastpath.layernorm_modulate.default(
        x, rows.materialize(), None, norm.weight, norm.bias, norm.eps, _fp32(norm)
    ),
    verify_key=_rows_signature,
    modules=(0,),
)


def layernorm_scale_rows(norm, x, scale, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1 + scale)`` where `scale` may be `SelectedRows` (Qwen-Image 2.1's where-picked rows: read
    through an index by the kernel, never written out), bit-identical to eager and self-verified per signature like
    `layernorm_scale`; a tensor scale is `layernorm_scale`'s."""
    if not isinstance(scale, SelectedRows):
        return layernorm_scale(norm, x, scale, site)
    name_site(site, LAYERNORM_SCALE_ROWS.name)
    return LAYERNORM_SCALE_ROWS(site, norm, x, scale)
