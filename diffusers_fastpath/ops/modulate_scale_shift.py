"""Fused adaLN modulate: ``x * (1 + scale[:, None]) + shift[:, None]`` in one pass over ``x``.

Formula and rounding points (T is the storage dtype, fp16 or bf16; every operation runs in fp32 and
``round`` rounds to nearest even in T), exactly those of the three eager kernels it replaces::

    out = round(round(x * round(1 + scale)) + shift)

so the result is ``torch.equal`` to eager PyTorch on any input. Shapes: ``x`` is ``[B, L, D]`` and contiguous;
``scale`` and ``shift`` are ``[B, D]`` (or ``[1, D]``) rows with unit innermost stride, such as the views that
``emb.chunk(6, dim=1)`` makes in diffusers' ``AdaLayerNormZero``: a size-1 dimension does not count against
contiguity, and for ``B > 1`` any row stride that keeps rows 16-byte aligned is taken without a copy. The kernel
is ``csrc/modulate_scale_shift.cu``.

Eager calls reach the CUDA op ``diffusers_fastpath::_modulate_scale_shift_cuda`` directly; ``torch.compile`` sees
the registered custom op ``diffusers_fastpath::modulate_scale_shift`` (device-generic, with a fake). Host time per
call on the H200 machine with torch 2.11 (``diffusers_fastpath.bench --kernels``, four runs on VMs whose host
speed varied by 1.8x): a plain ``x.add(1)`` 7.7-13.7 µs; the direct CUDA op the same; the Python custom op about
2.9x that (22.5-44.6 µs); this module's public entry with its guard and counters about 1.7x (12.6-24.0 µs); the
eager chain of three kernels about 3.6x. GPU time at (1, 4096, 3072) bf16: 16.8 µs against 69.7 µs eager, 88% of
a device-to-device copy's bandwidth.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from .selected_rows import IndexedRows, indexed_pair_reason, table_rows_aligned

_VEC_BYTES = 16  # one 16-byte vector load/store per thread and row


def modulate_scale_shift_ref(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The eager expression of diffusers' ``AdaLayerNormZero`` (and of the FLUX blocks' ``norm2`` sites)."""
    return x * (1 + scale[:, None]) + shift[:, None]


def _guard(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return rows_guard(x, scale, shift, x.dtype, check_pointers)


def rows_guard(x, scale, shift, rows_dtype: torch.dtype, check_pointers: bool = True) -> str | None:
    """The layout checks of a modulate with ``[B or 1, D]`` scale/shift rows of `rows_dtype` (x's, or float32 for
    the LayerNorm kernel's fp32 modulate, `layernorm_scale_shift_fp32`)."""
    dtype = x.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if scale.dtype is not rows_dtype or shift.dtype is not rows_dtype:
        return "mixed dtypes"
    if x.dim() != 3 or scale.dim() != 2 or shift.dim() != 2:
        return "shape"
    batch, _, dim = x.shape
    vec = _VEC_BYTES // x.element_size()
    if dim % vec:
        return f"D not a multiple of {vec}"
    # (each size and stride read once: this guard runs on every call of the adaLN sites, LayerNorm's included)
    (scale_rows, scale_dim), (shift_rows, shift_dim) = scale.shape, shift.shape
    if scale_dim != dim or shift_dim != dim or scale_rows not in (1, batch) or shift_rows not in (1, batch):
        return "shape"
    if x.numel() == 0:
        return "empty"
    if not x.is_contiguous():
        return "x not contiguous"
    rows_vec = _VEC_BYTES // scale.element_size()
    (scale_row, scale_col), (shift_row, shift_col) = scale.stride(), shift.stride()
    if not (scale_col == 1 and (scale_rows == 1 or scale_row % rows_vec == 0)
            and shift_col == 1 and (shift_rows == 1 or shift_row % rows_vec == 0)):
        return "scale/shift strided"
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or shift.requires_grad):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if scale.device != x.device or shift.device != x.device:
        return "devices differ"
    if check_pointers and (x.data_ptr() % _VEC_BYTES or scale.data_ptr() % _VEC_BYTES or shift.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


# The NVRTC way (ops/_nvrtc.py): csrc/modulate_scale_shift.cu's kernel, launched as its launch() and bindings.cpp's
# modulate_scale_shift(_out) do. Duplicated from there: kThreads 256 and kRowsInFlight 4 (tests/test_nvrtc.py reads
# them from the .cu), the batch strides (0 for a broadcast row) and the output allocation; the guard stands for
# bindings.cpp's input checks.
_NVRTC = _nvrtc.Kernel(
    "modulate_scale_shift.cu",
    "diffusers_fastpath::modulate_scale_shift_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("modulate_scale_shift_kernel", ("out", "P"), ("x", "P"), ("scale", "P"), ("shift", "P"),
                  ("rows", "q"), ("seq", "q"), ("vecs_per_row", "i"), ("scale_batch_stride", "q"),
                  ("shift_batch_stride", "q"), ("index", "P"), ("table_rows", "q")),
)
_THREADS, _ROWS_IN_FLIGHT = 256, 4


def _nvrtc_kernel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor | None = None,
                  index: torch.Tensor | None = None):
    # index: the indexed rows (modulate_scale_shift_rows): x [1, rows, dim], scale and shift the tables
    batch, seq, dim = x.shape
    if out is None:
        out = x.new_empty(x.shape)
    else:
        _nvrtc.check_out("modulate_scale_shift", out, x.shape, x, 16)
    rows, vecs, device = batch * seq, dim * x.element_size() // _VEC_BYTES, x.device.index
    grid, block = _nvrtc.row_grid(rows, vecs, _THREADS, _ROWS_IN_FLIGHT, _nvrtc.num_sms(device))
    indexed = index is not None
    _NVRTC.launch(device, x.dtype, grid, block, out.data_ptr(), x.data_ptr(), scale.data_ptr(), shift.data_ptr(), rows,
                  seq, vecs, 0 if scale.shape[0] == 1 and not indexed else scale.stride(0),
                  0 if shift.shape[0] == 1 and not indexed else shift.stride(0), index.data_ptr() if indexed else 0,
                  scale.shape[0] if indexed else 0)
    return out


_nvrtc.raw_op("_modulate_scale_shift_cuda", "(Tensor x, Tensor scale, Tensor shift) -> Tensor", _guard, _nvrtc_kernel)
_nvrtc.raw_op("_modulate_scale_shift_cuda_out", "(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()",
              _guard, _nvrtc_kernel, outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_modulate_scale_shift_cuda")


def _kernel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return _cuda_op(x, scale, shift)


@torch.library.custom_op("diffusers_fastpath::modulate_scale_shift", mutates_args=())
def _modulate_scale_shift_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    # The real implementation behind torch.compile: the kernel where the guard (now with real pointers) allows,
    # the eager expression elsewhere, so the op is exact on every device and every input.
    if _guard(x, scale, shift) is None:
        return _kernel(x, scale, shift)
    return modulate_scale_shift_ref(x, scale, shift).contiguous()


@_modulate_scale_shift_op.register_fake
def _modulate_scale_shift_fake(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 3, lambda: f"modulate_scale_shift: x must be [B, L, D], got {tuple(x.shape)}")
    torch._check(scale.dim() == 2 and shift.dim() == 2, lambda: "modulate_scale_shift: scale/shift must be [B, D]")
    shape = torch.broadcast_shapes(x.shape, (scale.shape[0], 1, scale.shape[1]), (shift.shape[0], 1, shift.shape[1]))
    dtype = torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)
    return x.new_empty(shape, dtype=dtype)


MODULATE_SCALE_SHIFT = FusedOp(
    "modulate_scale_shift",
    ref=modulate_scale_shift_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=torch.ops.diffusers_fastpath.modulate_scale_shift.default,
)


def modulate_scale_shift(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, site: Site | None = None
) -> torch.Tensor:
    """``x * (1 + scale[:, None]) + shift[:, None]``, fused on CUDA and bit-identical to eager everywhere.

    Args:
        x: ``[B, L, D]`` activations (the output of the adaLN LayerNorm).
        scale: ``[B, D]`` or ``[1, D]`` modulation scale.
        shift: ``[B, D]`` or ``[1, D]`` modulation shift.
        site: the call site's counters (fast calls, fallbacks with reasons), shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import modulate_scale_shift, modulate_scale_shift_ref
        >>> x, emb = torch.randn(1, 16, 64), torch.randn(1, 6 * 64)
        >>> shift, scale = emb.chunk(6, dim=1)[:2]
        >>> torch.equal(modulate_scale_shift(x, scale, shift), modulate_scale_shift_ref(x, scale, shift))
        True
    """
    return MODULATE_SCALE_SHIFT(site, x, scale, shift)


# --- indexed rows: MiniMax-H3's ``x * (1.0 + s.index_select(0, rows)) + t.index_select(0, rows)`` (selected_rows.py) --


def modulate_scale_shift_rows_ref(x: torch.Tensor, scale: IndexedRows, shift: IndexedRows) -> torch.Tensor:
    """The eager expression: both rows written out as the model writes them (the scale's first), then ``x * (1 +
    scale) + shift`` (``1`` and ``1.0`` are the same number in any floating dtype)."""
    scale_rows, shift_rows = scale.materialize(), shift.materialize()
    return x * (1 + scale_rows) + shift_rows


def _rows_guard(x, scale, shift, check_pointers: bool = True) -> str | None:
    if type(scale) is not IndexedRows or type(shift) is not IndexedRows:
        return "operand not a tensor"
    reason = indexed_pair_reason(scale, shift, x)
    if reason is not None:
        return reason
    if not x.is_contiguous():
        return "x not contiguous"
    table, other = scale.params, shift.params
    if scale.indices.requires_grad:
        return "requires grad"
    # the layout checks of one row of each table against x as [1, N, D] rows
    return rows_guard(x.view(1, -1, x.shape[-1]), table[:1], other[:1], x.dtype, check_pointers)


def _rows_raw_guard(x, scale, shift, index) -> str | None:
    """bindings.cpp's modulate_scale_shift_rows checks (the index's values are checked in the kernel, which traps)."""
    if not all(isinstance(t, torch.Tensor) for t in (x, scale, shift, index)) or x.dim() != 3:
        return "shape"
    if scale.dim() != 2 or shift.shape != scale.shape or scale.shape[0] == 0:
        return "scale and shift must be [rows, dim] tables of one shape"
    if (index.dtype is not torch.int32 or index.dim() != 1 or index.shape[0] != x.shape[0] * x.shape[1]
            or not index.is_contiguous() or index.device != x.device):
        return "index must be a contiguous int32 [batch * seq] tensor on x's device"
    if not (table_rows_aligned(scale) and table_rows_aligned(shift)):
        return "scale/shift strided"
    return rows_guard(x.view(1, -1, x.shape[-1]) if x.is_contiguous() else x, scale[:1], shift[:1], x.dtype)


def _nvrtc_rows(x, scale, shift, index):
    return _nvrtc_kernel(x.view(1, -1, x.shape[-1]), scale, shift, index=index).view(x.shape)


_nvrtc.raw_op("_modulate_scale_shift_rows_cuda", "(Tensor x, Tensor scale, Tensor shift, Tensor index) -> Tensor",
              _rows_raw_guard, _nvrtc_rows)

_rows_op = LazyLauncher(_nvrtc_rows, "_modulate_scale_shift_rows_cuda")


def _rows_kernel(x, scale, shift):
    x3 = x.view(1, -1, x.shape[-1])
    return _rows_op(x3, scale.table(), shift.table(), scale.index()).view(x.shape)


def _rows_custom_op(x, scale, shift):
    # torch.compile: the rows written out, then the registered modulate of x's [N, 1, D] rows (the same elements)
    scale_rows, shift_rows = scale.materialize(), shift.materialize()
    return _modulate_scale_shift_op(x.reshape(-1, 1, x.shape[-1]), scale_rows, shift_rows).view(x.shape)


MODULATE_SCALE_SHIFT_ROWS = FusedOp(
    "modulate_scale_shift_rows",
    ref=modulate_scale_shift_rows_ref,
    guard=_rows_guard,
    kernel=_rows_kernel,
    custom_op=_rows_custom_op,
    # exact by construction (values moved; the same three roundings); the first call of each signature is compared
    # with eager all the same, the index being narrowed to int32 by this package
    verify_key=lambda x, scale, shift: (str(x.dtype).removeprefix("torch."),),
)


def modulate_scale_shift_rows(x: torch.Tensor, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``x * (1 + scale) + shift`` where `scale` and `shift` are `IndexedRows` of one index (MiniMax-H3's
    ``s.index_select(0, rows)`` rows, ``[N, D]``, of an ``x`` of ``[1, N, D]`` or ``[N, D]``): the kernel reads
    each token's rows through the index (never written out; an index outside the tables traps there), with
    `modulate_scale_shift`'s three roundings, bit-identical to eager. The guard admits half ``x``, contiguous, both
    tables of x's dtype and shape with 16-byte aligned rows (`table_rows_aligned`); the fallback writes the rows out
    with the model's own call, then the expression.

    Args:
        x: the normalised activations.
        scale: the scale rows (`IndexedRows`).
        shift: the shift rows (`IndexedRows` of the same indices).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return MODULATE_SCALE_SHIFT_ROWS(site, x, scale, shift)
