"""Fused gated residual add: ``residual + gate * update`` in one pass.

Formula and rounding points (T is the storage dtype, fp16 or bf16; every operation runs in fp32 and ``round``
rounds to nearest even in T), exactly those of the two eager kernels it replaces::

    out = round(residual + round(gate * update))

so the result is ``torch.equal`` to eager PyTorch on any input. This is the residual update that closes every
FLUX.1 block branch (``hidden_states + gate_msa.unsqueeze(1) * attn_output`` and its three siblings in the dual
block, ``residual + gate * proj_out(...)`` in the single block). Shapes: ``residual`` and ``update`` are
``[B, L, D]`` and contiguous; ``gate`` is ``[B, 1, D]`` (or ``[1, 1, D]``), a row per batch such as diffusers'
``gate.unsqueeze(1)`` of an ``emb.chunk(6, dim=1)`` view (any batch stride that keeps rows 16-byte aligned, taken
without a copy), or a full ``[B, L, D]`` gate with such strides. The kernel is ``csrc/gated_residual.cu``; it moves
3 (row gate) or 4 (full gate) bytes per output byte against eager's 5 (or 6).

Eager calls reach the CUDA op ``diffusers_fastpath::_gated_residual_cuda`` directly; ``torch.compile`` sees the
registered custom op ``diffusers_fastpath::gated_residual`` (device-generic, with a fake), as for
`modulate_scale_shift` (whose docstring has the host-cost numbers that motivate this split).
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from ._unary_proof import FoldedProof, tanh_chain_ref
from .selected_rows import IndexedRows, SelectedRows, table_rows_aligned

_VEC_BYTES = 16  # one 16-byte vector load/store per thread and row


def gated_residual_ref(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``residual + gate * update`` (``gate`` already broadcastable, e.g. ``[B, 1, D]``)."""
    return residual + gate * update


def _guard(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return residual_guard(residual, gate, update, residual.dtype, check_pointers)


def residual_guard(residual, gate, update, gate_dtype: torch.dtype, check_pointers: bool) -> str | None:
    """The guard of both chains: the gate of `gate_dtype` (the residual's, or float32 for `gated_residual_fp32`); also
    the gated half of `gated_layernorm_scale_shift`'s."""
    if not (isinstance(residual, torch.Tensor) and isinstance(gate, torch.Tensor) and isinstance(update, torch.Tensor)):
        return "operand not a tensor"  # a Python scalar gate (``x + 0.5 * y``): eager broadcasts it
    dtype = residual.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if gate.dtype is not gate_dtype or update.dtype is not dtype:
        return "mixed dtypes"
    if residual.dim() != 3 or gate.dim() != 3 or update.shape != residual.shape:
        return "shape"
    batch, seq, dim = residual.shape
    gate_batch, gate_seq, gate_dim = gate.shape
    if gate_dim != dim or (gate_batch != batch and gate_batch != 1) or (gate_seq != seq and gate_seq != 1):
        return "shape"
    vec = _VEC_BYTES // residual.element_size()
    if dim % vec:
        return f"D not a multiple of {vec}"
    if residual.numel() == 0:
        return "empty"
    if not (residual.is_contiguous() and update.is_contiguous()):
        return "residual/update not contiguous"
    # Size-1 dimensions are broadcast (their strides are never read); the others must keep rows 16-byte aligned.
    gate_vec = _VEC_BYTES // gate.element_size()
    if (gate.stride(2) != 1 or (gate_batch != 1 and gate.stride(0) % gate_vec)
            or (gate_seq != 1 and gate.stride(1) % gate_vec)):
        return "gate strided"
    if torch.is_grad_enabled() and (residual.requires_grad or gate.requires_grad or update.requires_grad):
        return "requires grad"
    if not residual.is_cuda:
        return f"device {residual.device.type}"
    if gate.device != residual.device or update.device != residual.device:
        return "devices differ"
    if check_pointers and (residual.data_ptr() % _VEC_BYTES or update.data_ptr() % _VEC_BYTES or gate.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


# The NVRTC way (ops/_nvrtc.py): csrc/gated_residual.cu's kernel, launched as its launch() and bindings.cpp's
# gated_residual(_out) do. Duplicated from there: kThreads 256 and kRowsInFlight 4 (tests/test_nvrtc.py reads them from
# the .cu), the gate strides (0 where the gate broadcasts), the row-gate variant (gate_seq_stride 0) and the output
# allocation, the kernel of the gate's dtype (an fp32 gate: gated_residual_fp32's chain); the guard stands for
# bindings.cpp's input checks.
_NVRTC = _nvrtc.Kernel(
    "gated_residual.cu",
    "diffusers_fastpath::gated_residual_kernel",
    {(dtype, gate_dtype, row_gate): f"{_nvrtc.STORAGE_TYPE[dtype]}, "
     f"{'float' if gate_dtype is torch.float32 else _nvrtc.STORAGE_TYPE[dtype]}, {str(row_gate).lower()}"
     for dtype in HALF_DTYPES for gate_dtype in (dtype, torch.float32) for row_gate in (True, False)}
    # indexed rows of T with the gate's tanh taken of each value (kTanhGate: Qwen-Image 2.1's gates)
    | {(dtype, dtype, False, "tanh"): f"{_nvrtc.STORAGE_TYPE[dtype]}, {_nvrtc.STORAGE_TYPE[dtype]}, false, true"
       for dtype in HALF_DTYPES},
    _nvrtc.Params("gated_residual_kernel", ("out", "P"), ("residual", "P"), ("gate", "P"), ("update", "P"),
                  ("rows", "q"), ("seq", "q"), ("vecs_per_row", "i"), ("gate_batch_stride", "q"),
                  ("gate_seq_stride", "q"), ("index", "P"), ("table_rows", "q")),
)
_THREADS, _ROWS_IN_FLIGHT = 256, 4


def _nvrtc_kernel(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, out: torch.Tensor | None = None,
                  index: torch.Tensor | None = None, tanh_gate: bool = False):
    # index: the indexed rows (gated_residual_rows), gate the [1, rows, dim] view of the table; tanh_gate: the table
    # holds the rows before their tanh, which the kernel takes (indexed rows of the residual's dtype only)
    batch, seq, dim = residual.shape
    if out is None:
        out = residual.new_empty(residual.shape)
    else:
        _nvrtc.check_out("gated_residual", out, residual.shape, residual, 16)
    rows, vecs, device = batch * seq, dim * residual.element_size() // _VEC_BYTES, residual.device.index
    gate_batch_stride = 0 if gate.shape[0] == 1 or index is not None else gate.stride(0)
    gate_seq_stride = 0 if gate.shape[1] == 1 else gate.stride(1)
    row_gate = gate_seq_stride == 0 and index is None
    if tanh_gate and (index is None or gate.dtype is not residual.dtype):
        raise ValueError("gated_residual_rows: the gate's tanh is taken of indexed rows of x's dtype only")
    grid, block = _nvrtc.row_grid(rows, vecs, _THREADS, _ROWS_IN_FLIGHT, _nvrtc.num_sms(device))
    key = (residual.dtype, gate.dtype, False, "tanh") if tanh_gate else (residual.dtype, gate.dtype, row_gate)
    _NVRTC.launch(device, key, grid, block, out.data_ptr(), residual.data_ptr(),
                  gate.data_ptr(), update.data_ptr(), rows, seq, vecs, gate_batch_stride, gate_seq_stride,
                  0 if index is None else index.data_ptr(), 0 if index is None else gate.shape[1])
    return out




def _raw_guard(residual, gate, update, check_pointers: bool = True) -> str | None:
    """bindings.cpp's checks: the gate of the residual's dtype, or float32 (`gated_residual_fp32`'s chain)."""
    gate_dtype = torch.float32 if gate.dtype is torch.float32 else residual.dtype
    return residual_guard(residual, gate, update, gate_dtype, check_pointers)


_nvrtc.raw_op("_gated_residual_cuda", "(Tensor residual, Tensor gate, Tensor update) -> Tensor", _raw_guard,
              _nvrtc_kernel)
_nvrtc.raw_op("_gated_residual_cuda_out", "(Tensor(a!) out, Tensor residual, Tensor gate, Tensor update) -> ()",
              _raw_guard, _nvrtc_kernel, outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_gated_residual_cuda")


def _kernel(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    return _cuda_op(residual, gate, update)


@torch.library.custom_op("diffusers_fastpath::gated_residual", mutates_args=())
def _gated_residual_op(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    # The real implementation behind torch.compile: the kernel where the guard (now with real pointers) allows,
    # the eager expression elsewhere, so the op is exact on every device and every input.
    if _guard(residual, gate, update) is None:
        return _kernel(residual, gate, update)
    return gated_residual_ref(residual, gate, update).contiguous()


@_gated_residual_op.register_fake
def _gated_residual_fake(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    torch._check(residual.dim() == 3, lambda: f"gated_residual: residual must be [B, L, D], got {tuple(residual.shape)}")
    torch._check(gate.dim() == 3, lambda: f"gated_residual: gate must be [B, 1 or L, D], got {tuple(gate.shape)}")
    shape = torch.broadcast_shapes(residual.shape, gate.shape, update.shape)
    dtype = torch.promote_types(torch.promote_types(residual.dtype, gate.dtype), update.dtype)
    return residual.new_empty(shape, dtype=dtype)


GATED_RESIDUAL = FusedOp(
    "gated_residual",
    ref=gated_residual_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=torch.ops.diffusers_fastpath.gated_residual.default,
)


def gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, site: Site | None = None
) -> torch.Tensor:
    """``residual + gate * update``, fused on CUDA and bit-identical to eager everywhere.

    Args:
        residual: ``[B, L, D]`` residual stream.
        gate: ``[B, 1, D]`` (or ``[1, 1, D]``) gate row per batch, e.g. ``gate_msa.unsqueeze(1)``, or a full
            ``[B, L, D]`` gate.
        update: ``[B, L, D]`` branch output (attention, feed-forward, ``proj_out``).
        site: the call site's counters (fast calls, fallbacks with reasons), shown by `diffusers_fastpath.report`.

    A 2-D ``[L or 1, D]`` gate (rows a model selects per token, MiniMax-H3's ``gate.index_select(0, rows)``) is
    the ``[1, L or 1, D]`` one, a 1-D ``[D]`` gate the ``[1, 1, D]`` one: broadcasting prepends the size-1
    dimensions either way, so every element is the same product and sum (`as_batch_rows`).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import gated_residual, gated_residual_ref
        >>> x, out, emb = torch.randn(1, 16, 64), torch.randn(1, 16, 64), torch.randn(1, 6 * 64)
        >>> gate = emb.chunk(6, dim=1)[2].unsqueeze(1)
        >>> torch.equal(gated_residual(x, gate, out), gated_residual_ref(x, gate, out))
        True
    """
    return GATED_RESIDUAL(site, residual, as_batch_rows(gate, residual), update)


def as_batch_rows(gate: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`gate` as ``[1, L, D]`` where it is a 2-D ``[L, D]`` gate of a ``[B, L, D]`` residual, as ``[1, 1, D]`` where
    it is a 1-D ``[D]`` one: a view; broadcasting against a 3-D operand prepends those dimensions anyway, so the
    expression's every element and its result's shape and dtype are the same. A gate of one value per sample
    (``[1]``, ``[B or 1, 1, 1]``: Bria FIBO 2's ``self.cross_attn_gate.tanh()`` of a ``zeros(1)`` parameter) is
    written out as its ``[B or 1, 1, D]`` row (B x D elements; the kernel reads rows of D): each product is the same
    value times the same element (not where the gate requires grad: its gradient would be summed in another order).
    Else `gate` as it is."""
    if not (isinstance(gate, torch.Tensor) and isinstance(residual, torch.Tensor) and residual.dim() == 3):
        return gate
    if gate.dim() in (1, 2):
        gate = gate[(None,) * (3 - gate.dim())]
    if (gate.dim() == 3 and gate.shape[1:] == (1, 1) and residual.shape[-1] > 1
            and not (gate.requires_grad and torch.is_grad_enabled())):
        return gate.expand(gate.shape[0], 1, residual.shape[-1]).contiguous()
    return gate


# --- Wan's chain: the same kernel with an fp32 gate ---------------------------------------------------------------


def gated_residual_fp32_ref(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """The eager expression of Wan's blocks as diffusers writes the attention's: ``(residual.float() + update *
    gate).type_as(residual)``, for every dtype (a float64 update times a float32 gate is a float64 product, added to
    the float32 residual in float64). The FFN's ``update.float() * gate`` is the same product wherever the kernel
    runs (a half update, a float32 gate); the rewritten forward computes that form itself where it is not."""
    return (residual.float() + update * gate).type_as(residual)


def _guard_fp32(residual, gate, update, check_pointers: bool = True) -> str | None:
    return residual_guard(residual, gate, update, torch.float32, check_pointers)


@torch.library.custom_op("diffusers_fastpath::gated_residual_fp32", mutates_args=())
def _gated_residual_fp32_op(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    if _guard_fp32(residual, gate, update) is None:
        return _kernel(residual, gate, update)
    return gated_residual_fp32_ref(residual, gate, update).contiguous()


@_gated_residual_fp32_op.register_fake
def _gated_residual_fp32_fake(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    torch._check(residual.dim() == 3, lambda: f"gated_residual_fp32: residual must be [B, L, D], got {tuple(residual.shape)}")
    torch._check(gate.dim() == 3, lambda: f"gated_residual_fp32: gate must be [B, 1 or L, D], got {tuple(gate.shape)}")
    return residual.new_empty(torch.broadcast_shapes(residual.shape, gate.shape, update.shape))


GATED_RESIDUAL_FP32 = FusedOp(
    "gated_residual_fp32",
    ref=gated_residual_fp32_ref,
    guard=_guard_fp32,
    kernel=_kernel,  # the raw op takes the fp32 gate and computes this chain (csrc/gated_residual.cu)
    custom_op=torch.ops.diffusers_fastpath.gated_residual_fp32.default,
)


def gated_residual_fp32(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, site: Site | None = None
) -> torch.Tensor:
    """``(residual.float() + update * gate).type_as(residual)`` (Wan's gated residuals: fp16/bf16 streams, an fp32
    gate), fused on CUDA and bit-identical to eager everywhere: the product and the sum are fp32 results
    (``__fmul_rn``, ``__fadd_rn``), rounded to the residual's dtype once. For such operands ``update.float() * gate``
    (Wan's FFN line) is the same product.

    Args:
        residual: ``[B, L, D]`` residual stream (fp16 or bf16 for the kernel).
        gate: float32 ``[B, 1, D]`` (or ``[1, 1, D]``) row per batch, or a full ``[B, L, D]`` gate (Wan 2.2 TI2V's
            per-token modulation), rows 16-byte aligned.
        update: ``[B, L, D]`` branch output of the residual's dtype.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return GATED_RESIDUAL_FP32(site, residual, as_batch_rows(gate, residual), update)


# --- indexed gate rows: Qwen-Image 2.1's ``x + gate.tanh() * y`` with where-picked gates, MiniMax-H3's ``x +
# gate.index_select(0, rows) * y`` (ops/selected_rows.py) --------------------------------------------------------------


def gated_residual_rows_ref(residual: torch.Tensor, rows: SelectedRows | IndexedRows, update: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``residual + rows * update`` with the rows as the model computes them."""
    return residual + rows.materialize() * update


def _rows_guard(residual, rows, update, check_pointers: bool = True) -> str | None:
    if type(rows) not in (SelectedRows, IndexedRows):
        return "operand not a tensor"
    reason = rows.reason(residual)
    if reason is not None:
        return reason
    table = rows.params  # the table's layout is params' (a gate's tanh table is contiguous: checked alike)
    return residual_guard(residual, table.unsqueeze(0)[:, :1], update, residual.dtype, check_pointers) or (
        None if table_rows_aligned(table) else "gate strided")


def _rows_raw_guard(residual, table, index, update, tanh_gate: bool = False) -> str | None:
    """bindings.cpp's gated_residual_rows checks (the index's values are the caller's: built from a mask)."""
    if not (isinstance(table, torch.Tensor) and isinstance(index, torch.Tensor)) or table.dim() != 2:
        return "shape"
    if (index.dtype is not torch.int32 or not index.is_contiguous() or not isinstance(residual, torch.Tensor)
            or residual.dim() != 3 or index.shape != residual.shape[:2] or index.device != residual.device):
        return "index must be a contiguous int32 [batch, seq] tensor on x's device"
    if not table_rows_aligned(table):
        return "gate strided"
    return residual_guard(residual, table.unsqueeze(0)[:, :1], update, residual.dtype, True)


def _nvrtc_rows(residual, table, index, update, tanh_gate: bool = False):
    return _nvrtc_kernel(residual, table.unsqueeze(0), update, index=index, tanh_gate=tanh_gate)


_nvrtc.raw_op("_gated_residual_rows_cuda",
              "(Tensor residual, Tensor table, Tensor index, Tensor update, bool tanh_gate=False) -> Tensor",
              _rows_raw_guard, _nvrtc_rows)

_rows_op = LazyLauncher(_nvrtc_rows, "_gated_residual_rows_cuda")


def _tanh_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel's gate tanh on a ``[1, 1, n]`` row (`_unary_proof.FoldedProof`): the row as a one-row table (padded
    to whole vectors), every token picking it, a residual of -0 and an update of 1 (`tanh_chain_ref`)."""
    n = row.shape[-1]
    width = -(-n // 8) * 8
    table = row.new_zeros(1, width)
    table[0, :n] = row.view(-1)
    index = torch.zeros(1, 1, dtype=torch.int32, device=row.device)
    residual, update = row.new_full((1, 1, width), -0.0), row.new_ones((1, 1, width))
    return _rows_op(residual, table, index, update, True)[..., :n]


# gated_residual.cu's kTanhGate: its tanh of the gate's values against aten's, once per device and dtype
TANH_FOLDED = FoldedProof("gated_residual_rows' tanh of the gate rows", _tanh_probe, tanh_chain_ref)


def _folds_tanh(residual, rows) -> bool:
    """Whether the kernel takes the tanh of `rows` itself: `SelectedRows.read_later`'s rows whose table aten has not
    computed, and the kernel's tanh proven on this device and dtype (`TANH_FOLDED`)."""
    return type(rows) is SelectedRows and rows.folds_tanh and TANH_FOLDED.holds(residual.device, residual.dtype)


def _rows_kernel(residual, rows, update):
    # (an IndexedRows' [N] index is the [1, N] one of a [1, N, D] residual: `reason` admits no other)
    index = rows.index().view(residual.shape[:2])
    if _folds_tanh(residual, rows):  # the rows before their tanh, taken in the kernel
        return _rows_op(residual, rows.params, index, update, True)
    return _rows_op(residual, rows.table(), index, update)


GATED_RESIDUAL_ROWS = FusedOp(
    "gated_residual_rows",
    ref=gated_residual_rows_ref,
    guard=_rows_guard,
    kernel=_rows_kernel,
    # torch.compile: the rows written out, then the registered gated_residual (the patched method makes no
    # SelectedRows while compiling; this is for a caller that does)
    custom_op=lambda residual, rows, update: _gated_residual_op(residual, as_batch_rows(rows.materialize(), residual),
                                                                update),
    # exact by construction (values moved, the tanh aten's on the same values); the first call of each signature
    # is compared with eager all the same, the tanh being computed on other tensors than eager's (and the index
    # of IndexedRows narrowed to int32 by this package)
    # (and whether the kernel took the tanh itself: `_folds_tanh`, decided once per device and dtype)
    verify_key=lambda residual, rows, update: (str(residual.dtype).removeprefix("torch."), type(rows).__name__,
                                               rows.tanh, "tanh in kernel" if _folded(residual, rows) else ""),
)


def _folded(residual, rows) -> bool:
    # what `_rows_kernel` chose for these rows (read after it ran: the proof's answer is kept, the table not made)
    return (type(rows) is SelectedRows and rows.folds_tanh
            and TANH_FOLDED.known(residual.device, residual.dtype))


def gated_residual_rows(residual: torch.Tensor, gate, update: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``residual + gate * update`` where `gate` may be `SelectedRows` or `IndexedRows` (rows picked per token from a
    table: the kernel reads them through an index, never written out; an index outside the table traps there),
    bit-identical to eager; a tensor gate is `gated_residual`'s. The fallback writes the rows out as the model
    does."""
    if type(gate) not in (SelectedRows, IndexedRows):
        return gated_residual(residual, gate, update, site)
    return GATED_RESIDUAL_ROWS(site, residual, gate, update)
