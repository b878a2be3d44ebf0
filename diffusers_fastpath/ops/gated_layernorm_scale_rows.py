"""Qwen-Image 2.1's in-block pair in one pass: the attention's gated residual update and the LayerNorm + scale of
the new stream, with both rows picked per token (`selected_rows.SelectedRows`), bit-identical to eager::

    hidden_states = hidden_states + img_gate1.tanh() * attn_output
    img_modulated2, img_gate2 = self._modulate(self.img_norm2(hidden_states), mod2, target_token_mask)

Run apart (`gated_residual_rows`, then `layernorm_scale_rows`), the update writes the stream and the LayerNorm reads
it back. Here one kernel (``csrc/layernorm_scale_shift.cu``'s gated form, FLUX.1's `gated_layernorm_scale_shift`,
with its gate and its scale read through the rows' int32 indices) reads the residual and the update, computes
``x = round(residual + round(gate * update))`` (`gated_residual`'s two rounding points) with the gate row its index
picks from the ``tanh`` table, writes ``x``, and keeps the row in registers for the LayerNorm statistics (aten's order,
as `layernorm_scale_shift`) and the scale-only modulate ``round(round(norm(x)) * round(1 + scale))`` with the scale
row its index picks (`layernorm_scale`'s form): two reads and two writes of the stream instead of five, one launch
instead of two. Returns ``(x, out)``: the new stream (read by the block's next residual) and the modulated norm.

The update is exact by construction; the LayerNorm reproduces a property of the aten build, so the op verifies
itself as `layernorm_scale_rows` does: the first fast call of each signature (dtype, D, the norm's kind and affine)
is compared with eager by ``torch.equal``; a mismatch disables it for the process with one warning and that call
returns the eager result. The reference is the model's own expressions (the rows written out by its function, the
norm module called); the fallback is the two fused ops, each exact and with its own guard.

Guard (the reason is counted on the site): both rows `SelectedRows` whose ``where`` gives the residual's shape; the
gate's `gated_residual_rows` guard and the scale's `layernorm_scale_rows` guard on the residual (the row the
statistics run over): fp16/bf16 ``[B, S, D]`` contiguous, 16-byte aligned, D a multiple of 8 and at most 6144, the
norm a LayerNorm over the last dim (its hooks refuse the call), no autograd.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .gated_residual import _rows_guard as _gate_rows_guard
from .gated_residual import gated_residual_rows, gated_residual_rows_ref, residual_guard
from .layernorm_modulate import _affine_rows, _fp32, _norm_signature, _norm_unfit, _raw_rows_guard
from .layernorm_modulate import _rows_guard as _scale_rows_guard
from .layernorm_modulate import layernorm_scale_rows, layernorm_scale_rows_ref
from .layernorm_scale_shift import _cuda_ops, _nvrtc_kernel
from ._unary_proof import FoldedProof, tanh_chain_ref
from .selected_rows import SelectedRows, table_rows_aligned


def gated_layernorm_scale_rows_ref(norm, residual, gate, update, scale):
    """The eager chain: ``x = residual + gate * update`` and ``norm(x) * (1 + scale)`` with the rows as the model
    computes them; returns ``(x, that)``."""
    x = gated_residual_rows_ref(residual, gate, update)
    return x, layernorm_scale_rows_ref(norm, x, scale)


def _fallback(norm, residual, gate, update, scale):
    # the two fused ops, each exact on its own (and each with its own guard)
    x = gated_residual_rows(residual, gate, update)
    return x, layernorm_scale_rows(norm, x, scale)


def _guard(norm, residual, gate, update, scale, check_pointers: bool = True) -> str | None:
    if type(gate) is not SelectedRows or type(scale) is not SelectedRows:
        return "operand not a tensor"
    # what the model's shapes decide first (the norm, the rows' broadcast), then each half's own guard
    reason = _norm_unfit(norm, residual, check_pointers) or gate.reason(residual) or scale.reason(residual)
    if reason is not None:
        return reason
    return (_gate_rows_guard(residual, gate, update, check_pointers)
            or _scale_rows_guard(norm, residual, scale, check_pointers))


def _raw_guard(residual, gate, gate_index, update, scale, shift, index, weight, bias, eps,
               tanh_gate: bool = False) -> str | None:
    """bindings_norms.cpp's gated_layernorm_modulate_rows checks (the indices' values are the caller's: built from a
    mask)."""
    if not (isinstance(gate, torch.Tensor) and gate.dim() == 2 and isinstance(gate_index, torch.Tensor)):
        return "shape"
    if not (isinstance(residual, torch.Tensor) and residual.dim() == 3 and gate_index.dtype is torch.int32
            and gate_index.is_contiguous() and gate_index.shape == residual.shape[:2]
            and gate_index.device == residual.device):
        return "index must be a contiguous int32 [batch, seq] tensor on x's device"
    if not table_rows_aligned(gate):
        return "gate strided"
    return (residual_guard(residual, gate.unsqueeze(0)[:, :1], update, residual.dtype, True)
            or _raw_rows_guard(residual, scale, shift, index, weight, bias, eps))


def _nvrtc_gated_rows(residual, gate, gate_index, update, scale, shift, index, weight, bias, eps: float,
                      tanh_gate: bool = False):
    # layernorm_modulate's rows launch (ops/layernorm_modulate.py) with the gated prologue: the gate an [R, dim] table
    # (tanh_gate: its rows before their tanh, which the kernel takes)
    x_out = residual.new_empty(residual.shape)
    strides = tuple(0 if t is None or t.shape[0] == 1 else t.stride(0) for t in (scale, shift))
    out = _nvrtc_kernel(residual, scale[:1], None if shift is None else shift[:1], eps, seq_strides=strides,
                        norm_weight=weight, norm_bias=bias, row_index=index, gate=gate, update=update, x_out=x_out,
                        gate_index=gate_index, tanh_gate=tanh_gate)
    return x_out, out


_nvrtc.raw_op("_gated_layernorm_modulate_rows_cuda",
              "(Tensor residual, Tensor gate, Tensor gate_index, Tensor update, Tensor scale, Tensor? shift, "
              "Tensor index, Tensor? weight, Tensor? bias, float eps, bool tanh_gate=False) -> (Tensor, Tensor)",
              _raw_guard, _nvrtc_gated_rows)

_launch = LazyLauncher(_nvrtc_gated_rows, "_gated_layernorm_modulate_rows_cuda")

_PROBE_WIDTH = 4096  # the probe's rows: 16 of them hold the 65536 values of a dtype


def _tanh_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel's gate tanh on a ``[1, 1, n]`` row (`_unary_proof.FoldedProof`): the row as a table of rows of
    4096 (padded with zeros), token s picking row s, a residual of -0 and an update of 1 (`tanh_chain_ref`): the
    written stream is the gated update, the LayerNorm's output (of a zero scale row) not read."""
    n = row.shape[-1]
    rows = -(-n // _PROBE_WIDTH)
    table = row.new_zeros(rows * _PROBE_WIDTH)
    table[:n] = row.view(-1)
    table = table.view(rows, _PROBE_WIDTH)
    gate_index = torch.arange(rows, dtype=torch.int32, device=row.device).view(1, rows)
    residual, update = row.new_full((1, rows, _PROBE_WIDTH), -0.0), row.new_ones((1, rows, _PROBE_WIDTH))
    scale = row.new_zeros(1, _PROBE_WIDTH)
    x, _ = _launch(residual, table, gate_index, update, scale, None, torch.zeros_like(gate_index), None, None, 1e-6,
                   True)
    return x.view(1, 1, -1)[..., :n]


# layernorm_scale_shift.cu's kTanhGate: its tanh of the gate's values against aten's, once per device and dtype
TANH_FOLDED = FoldedProof("gated_layernorm_scale_rows' tanh of the gate rows", _tanh_probe, tanh_chain_ref)


def _kernel(norm, residual, gate, update, scale):
    if gate.folds_tanh and TANH_FOLDED.holds(residual.device, residual.dtype):  # the rows before their tanh
        return _launch(residual, gate.params, gate.index(), update, scale.table(), None, scale.index(),
                       *_affine_rows(norm), norm.eps, True)
    return _launch(residual, gate.table(), gate.index(), update, scale.table(), None, scale.index(),
                   *_affine_rows(norm), norm.eps)


def _signature(norm, residual, gate, update, scale):
    # what one torch.equal check vouches for: the norm's aten instantiation and row length (the gated update and the
    # rows' addressing are exact by construction), and whether the kernel took the gate's tanh itself (`_kernel`:
    # decided once per device and dtype, the table then not made)
    folded = gate.folds_tanh and TANH_FOLDED.known(residual.device, residual.dtype)
    return (*_norm_signature(norm, residual), "gated indexed rows", "scale only", "tanh in kernel" if folded else "")


def _compiled(norm, residual, gate, update, scale):
    # torch.compile: the rows written out, then the registered gated residual and layernorm_modulate (no
    # SelectedRows is made while compiling; this is for a caller that does)
    x = torch.ops.diffusers_fastpath.gated_residual.default(residual, gate.materialize(), update)
    out = torch.ops.diffusers_fastpath.layernorm_modulate.default(x, scale.materialize(), None, norm.weight, norm.bias,
                                                                  norm.eps, _fp32(norm))
    return x, out


GATED_LAYERNORM_SCALE_ROWS = FusedOp(
    "gated_layernorm_scale_rows",
    ref=gated_layernorm_scale_rows_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=_compiled,
    verify_key=_signature,
    fallback=_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def gated_layernorm_scale_rows(norm, residual, gate, update, scale, site: Site | None = None):
    """``x = residual + gate * update`` and ``norm(x) * (1 + scale)`` in one kernel, where `gate` and `scale` are
    `SelectedRows` (Qwen-Image 2.1's where-picked rows: the gate's ``tanh`` rows and the scale rows, each read through
    its index, never written out), bit-identical to eager and self-verified per signature (module doc); elsewhere
    the two fused ops `gated_residual_rows` and `layernorm_scale_rows`.

    Args:
        norm: the ``torch.nn.LayerNorm`` (or ``FP32LayerNorm``) of the site; it runs itself on fallback.
        residual: ``[B, S, D]`` stream.
        gate: the gate rows (`SelectedRows`, through ``tanh_rows`` where the model reads ``gate.tanh()``).
        update: ``[B, S, D]`` branch output.
        scale: the scale rows (`SelectedRows`).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Returns:
        ``(x, out)``: the new stream and its modulated norm.

    Example:
        >>> import torch
        >>> from diffusers.models.transformers.transformer_qwenimage21 import _select_modulation_rows
        >>> from diffusers_fastpath.ops.gated_layernorm_scale_rows import (gated_layernorm_scale_rows,
        ...                                                               gated_layernorm_scale_rows_ref)
        >>> from diffusers_fastpath.ops.selected_rows import SelectedRows
        >>> norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        >>> residual, update, mod = torch.randn(2, 16, 64), torch.randn(2, 16, 64), torch.randn(3, 128)
        >>> mask = torch.arange(16) >= 4
        >>> gate = SelectedRows(_select_modulation_rows, mod[:, :64], mask).tanh_rows()
        >>> scale = SelectedRows(_select_modulation_rows, mod[:, 64:], mask)
        >>> args = (norm, residual, gate, update, scale)
        >>> all(map(torch.equal, gated_layernorm_scale_rows(*args), gated_layernorm_scale_rows_ref(*args)))
        True
    """
    return GATED_LAYERNORM_SCALE_ROWS(site, norm, residual, gate, update, scale)
