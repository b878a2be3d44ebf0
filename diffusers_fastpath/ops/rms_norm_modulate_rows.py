"""torch's ``nn.RMSNorm`` and the adaLN modulate of rows picked per token with ``index_select``, in one pass,
bit-identical to eager.

``MiniMaxH3TransformerBlock.forward`` writes, T the activations' dtype (bf16 or fp16)::

    norm_hidden_states = self.norm1(hidden_states)            # torch.nn.RMSNorm(D), weight of T
    norm_hidden_states = norm_hidden_states * (1.0 + scale_msa.index_select(0, adaln_indices)) + shift_msa.index_select(
        0, adaln_indices)                                      # [T * 3, D] tables, [N] indices: [N, D] rows

(the same for ``norm2``, and ``MiniMaxH3AdaLayerNormOut`` returns its norm's modulate of ``timestep_indices`` rows).
The rounding points::

    y   = round_T(w * (rstd * x))                   # aten's fused rms_norm (below), w the T weight read as float
    a   = round_T(1 + scale[index[r]])              # the rows as index_select writes them: values moved
    out = round_T(round_T(y * a) + shift[index[r]])

Eager runs the norm's kernel (reading x twice, writing y), two ``index_select`` copies of ``[N, D]`` and the
modulate's three kernels (the last two over the whole activation); the kernel is ``csrc/rotary.cu``'s row norm
(``row_norm_rotary_kernel``) in its ``kNormModulateRows`` form: x read once, the modulated rows written once, the
normalised rows and the picked rows never stored (the tables are read through the index, `selected_rows.IndexedRows`,
as `modulate_scale_shift_rows` reads them). torch runs ``nn.RMSNorm`` on CUDA as ``aten::rms_norm`` ->
``_fused_rms_norm`` -> ``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` (8-byte aligned rows and weight, C
a multiple of 4): one (32, 4) block per row, thread t squaring elements 4(t + 128k)..4(t + 128k) + 3 in an FMA chain,
the shuffle-down tree over 16..1, the shared-memory halving of the four warps, ``rsqrtf(sum / C + eps)``: the order
`qk_norm_rows_rope` reproduces for LTX-Video's and Wan's QK norms of whole rows (``tools/rms_norm_order_probe.py``
on the H200: 100% of rows at C = 2048, 3072, 5120, bf16 and fp16), the same kernel with the weight of x's dtype. That
order is a property of the aten build, so the op verifies itself: the first fast call of each (dtype, C) is compared
with eager by ``torch.equal``; a mismatch disables it for the process with one warning, and the norm runs as written
with the modulate still fused (`modulate_scale_shift_rows`, exact by construction).

What the guard admits: scale and shift `IndexedRows` of one index object (MiniMax-H3's ``index_select`` rows, as the
rewriter hands them over: `models._chain_index_rows`) over tables of one shape, of x's dtype, with 16-byte row
strides (`table_rows_aligned`), ``[N, D]`` rows against an x of ``[..., N, D]`` with every leading dimension 1
(`IndexedRows.reason`); the norm exactly ``torch.nn.RMSNorm(D)`` with a contiguous weight of x's dtype and an eps
(aten's composite path, another order, runs for a weight of another dtype); a contiguous bf16/fp16 x with D a multiple
of 4 up to 8192, x, the weight and the tables 8-byte aligned; no autograd; on CUDA. A norm with hooks (its own, a
forward replaced on the instance or the class, global ones) refuses before the guard: the fallback calls the module,
so they run. An index outside the tables traps in the kernel, as eager's ``index_select`` fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site, autograd_device_reason, tensor_reason
from .modulate_scale_shift import modulate_scale_shift_rows
from .qk_norm_rope import MAX_ROW_CHANNELS, ROW_NORM_FINAL, plain_norm_reason
from .selected_rows import IndexedRows, indexed_pair_reason, materialized
from .zero_centred_rmsnorm import nvrtc_zero_centred

NOT_INDEXED = "rows not picked through an index"


def rms_norm_modulate_rows_ref(norm: nn.Module, x: torch.Tensor, scale, shift) -> torch.Tensor:
    """The eager chain as MiniMax-H3 writes it: the norm's call, then both rows written out by the model's own
    ``index_select`` (the scale's first), then ``y * (1.0 + scale) + shift``."""
    normed = norm(x)
    return normed * (1.0 + materialized(scale)) + materialized(shift)


def rms_norm_modulate_rows_arithmetic(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                      index: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's computation from the tensors (x ``[B, S, D]``, the ``[rows, D]`` tables, the int32 ``[B * S]``
    index): torch's rms_norm of x, then each row's table rows and the modulate's three roundings; an index outside
    the tables raises ``IndexError`` where the kernel traps (the tests' emulated kernel)."""
    picked = index.long()
    if picked.numel() and not (0 <= int(picked.min()) and int(picked.max()) < scale.shape[0]):
        raise IndexError("index out of range (the kernel traps)")
    normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return normed * (1.0 + scale[picked].view(x.shape)) + shift[picked].view(x.shape)


def _fallback(norm, x, scale, shift):
    """The norm module's call (its hooks run), then the modulate of the rows read through the index
    (`modulate_scale_shift_rows`, exact by construction; its own fallback writes the rows out as the model does)."""
    normed = norm(x)
    if type(scale) is IndexedRows and type(shift) is IndexedRows and isinstance(normed, torch.Tensor):
        return modulate_scale_shift_rows(normed, scale, shift)
    return normed * (1.0 + materialized(scale)) + materialized(shift)


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    if type(scale) is not IndexedRows or type(shift) is not IndexedRows:
        return NOT_INDEXED
    reason = tensor_reason(x, HALF_DTYPES, 2, "[..., N, D]") or indexed_pair_reason(scale, shift, x)
    if reason is not None:
        return reason
    dim = x.shape[-1]
    reason = plain_norm_reason(norm, dim, x.dtype)
    if reason is not None:
        return reason
    weight = norm.weight
    if dim % 4 or not 0 < dim <= MAX_ROW_CHANNELS:
        return "D outside the reproduced reduction"
    if x.numel() == 0:
        return "empty"
    if x.shape[-2] > 0x7FFFFFFF:
        return "more than 2^31 - 1 rows"
    if not x.is_contiguous():
        return "x not contiguous"
    if not weight.is_contiguous():
        return "norm weight strided"
    table, other = scale.params, shift.params
    reason = autograd_device_reason(x, weight, table, other)
    if reason is not None:
        return reason
    if check_pointers and (x.data_ptr() % 8 or weight.data_ptr() % 8 or table.data_ptr() % 8 or other.data_ptr() % 8):
        return "not 8-byte aligned"  # aten's vectorised kernel needs 8-byte aligned rows and weight
    return None


# The NVRTC way: zero_centred_rmsnorm's launcher with the weight of x's dtype, the tables and the index
# (bindings_rotary.cpp's rms_norm_modulate_rows); the raw guard stands for its checks.
def _nvrtc_kernel(x, weight, scale, shift, index, eps: float, norm_final: int) -> torch.Tensor:
    return nvrtc_zero_centred(x, weight, eps, norm_final, scale, shift, index)


def _raw_guard(x, weight, scale, shift, index, eps, norm_final) -> str | None:
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.dtype in HALF_DTYPES and x.is_contiguous()):
        return "x"
    if (x.shape[2] % 4 or x.shape[2] > MAX_ROW_CHANNELS or x.shape[0] > 65535 or x.shape[1] > 0x7FFFFFFF
            or x.data_ptr() % 8):
        return "C, rows or alignment"
    if not (weight.dim() == 1 and weight.shape[0] == x.shape[2] and weight.dtype is x.dtype and weight.is_contiguous()
            and weight.device == x.device and weight.data_ptr() % 8 == 0):
        return "weight"
    if not (scale.dim() == 2 and scale.shape == shift.shape and 0 < scale.shape[0] <= 0x7FFFFFFF
            and scale.shape[1] == x.shape[2]):
        return "scale and shift must be [rows, C] tables of one shape"
    for t in (scale, shift):
        if not (t.stride(1) == 1 and (t.shape[0] == 1 or t.stride(0) % 4 == 0) and t.dtype is x.dtype
                and t.device == x.device and t.data_ptr() % 8 == 0):
            return "scale or shift"
    if not (index.dtype is torch.int32 and index.dim() == 1 and index.shape[0] == x.shape[0] * x.shape[1]
            and index.is_contiguous() and index.device == x.device):
        return "index must be a contiguous int32 [batch * seq] tensor on x's device"
    if norm_final not in (0, 1, 2):
        return "norm_final"
    if not x.is_cuda:
        return "device"
    return None


_nvrtc.raw_op("_rms_norm_modulate_rows_cuda",
              "(Tensor x, Tensor weight, Tensor scale, Tensor shift, Tensor index, float eps, int norm_final) "
              "-> Tensor", _raw_guard, _nvrtc_kernel)

# (x [1, N, D], weight, scale and shift tables, index, eps, norm_final)
_launch = LazyLauncher(_nvrtc_kernel, "_rms_norm_modulate_rows_cuda")


def _kernel(norm, x, scale, shift):
    """The kernel over x's ``[N, D]`` rows (the guard saw every leading dimension 1), the tables and the index."""
    rows = x.view(1, -1, x.shape[-1])
    out = _launch(rows, norm.weight, scale.table(), shift.table(), scale.index(), norm.eps, ROW_NORM_FINAL)
    return out.view(x.shape)


RMS_NORM_MODULATE_ROWS = FusedOp(
    "rms_norm_modulate_rows",
    ref=rms_norm_modulate_rows_ref,
    guard=_guard,
    kernel=_kernel,
    # (torch.compile never sees the rows as `IndexedRows`: `index_rows` hands it the written-out rows there, which the
    # guard refuses, so the norm's call and the registered modulate op run; nothing of this op is traced)
    custom_op=_fallback,
    verify_key=lambda norm, x, *rows: (str(x.dtype).removeprefix("torch."), x.shape[-1], "rms_norm modulate rows"),
    fallback=_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rms_norm_modulate_rows(norm: nn.Module, x: torch.Tensor, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1.0 + scale) + shift`` for a ``torch.nn.RMSNorm`` `norm` and rows `scale`, `shift` picked with
    ``index_select`` (`IndexedRows` of one index: MiniMax-H3's), in one pass on CUDA (self-verified), bit-identical to
    eager everywhere.

    Args:
        norm: the ``torch.nn.RMSNorm(D)`` (weight of x's dtype); called as a module where the kernel refuses (its
            hooks run).
        x: ``[1, N, D]`` (or ``[N, D]``) bf16/fp16 activations, contiguous.
        scale, shift: `IndexedRows` of ``[rows, D]`` tables of x's dtype and one ``[N]`` index.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import rms_norm_modulate_rows, rms_norm_modulate_rows_ref
        >>> from diffusers_fastpath.ops.selected_rows import IndexedRows
        >>> norm, x = torch.nn.RMSNorm(64, eps=1e-6).bfloat16(), torch.randn(1, 8, 64).bfloat16()
        >>> tables, index = torch.randn(6, 128).bfloat16().chunk(2, dim=-1), torch.tensor([0, 1, 1, 2, 5, 0, 3, 4])
        >>> rows = [IndexedRows(t, index) for t in tables]
        >>> with torch.no_grad():
        ...     torch.equal(rms_norm_modulate_rows(norm, x, *rows), rms_norm_modulate_rows_ref(norm, x, *rows))
        True
    """
    return RMS_NORM_MODULATE_ROWS(site, norm, x, scale, shift)
