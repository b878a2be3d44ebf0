"""FLUX.1's adaLN in one pass: ``norm(x) * (1 + scale[:, None]) + shift[:, None]`` with ``norm`` a
``torch.nn.LayerNorm`` without affine, bit-identical to eager.

Eager runs four kernels (T the storage dtype, every operation in fp32, ``round`` to nearest even in T)::

    y   = F.layer_norm(x, (D,), None, None, eps)        # aten's vectorized_layer_norm_kernel
    out = round(round(y * round(1 + scale)) + shift)     # the modulate, see modulate_scale_shift

The kernel (``csrc/layernorm_scale_shift.cu``) reads ``x`` once and writes ``out`` once. It reproduces aten's
LayerNorm statistics step by step: the per-thread Welford updates over 4-element loads, the warp shuffle tree and the
shared-memory combine of a (32, 4) block, and the FMAs that nvcc contracts in aten's build (the file lists them and
where they come from); then ``rstd * (x - mean)`` rounded to T and the modulate's three rounding points. Which FMAs
nvcc contracted is a property of the aten build, so the op verifies itself: the first fast call of each signature
(dtype, D) is compared with the reference by ``torch.equal``, and a mismatch disables it for the process with one
warning. ``tools/layernorm_order_probe.py`` tells which of the kernel's reduction variants a given aten matches.

The reference, used for the fallback and for that check, is the LayerNorm module itself followed by the fused
`modulate_scale_shift` op: the lossless path FLUX.1 ran before this op existed, bit-identical to eager's four kernels
(its modulate kernel is exact on any input), so a guarded-out or disabled call loses only the LayerNorm fusion.

Shapes and layouts are the modulate's (its guard is reused): ``x`` ``[B, L, D]`` contiguous and 16-byte aligned,
``scale``/``shift`` ``[B, D]`` or ``[1, D]`` rows with unit innermost stride and 16-byte aligned rows (the
``emb.chunk(6, dim=1)`` views of ``AdaLayerNormZero`` are taken without a copy). On top of that: ``norm`` is exactly
``torch.nn.LayerNorm`` over the last dimension without weight or bias (so ``FP32LayerNorm`` and affine norms stay
eager), and D is at most 6144 (the row is kept in registers between the two passes). aten takes its vectorized path
for every such input (a contiguous row, D a multiple of 4, 8-byte aligned): the configuration the kernel reproduces.

Wan's chains run the same kernel over the upcast stream (aten's fp32 instantiation, the same statistics): its adaLN
sites with fp32 scale/shift rows (`layernorm_scale_shift_fp32`) and its ``norm2``, an ``FP32LayerNorm`` with weight
and bias (`layernorm_affine_fp32`: aten's affine epilogue ``gamma * y + beta`` contracted to one FMA, then one
rounding), each self-verified the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm

from . import _nvrtc
from ._build import LazyLauncher, load_extension
from ._policy import FusedOp, Site
from .gated_residual import gated_residual, gated_residual_ref, residual_guard
from .modulate_scale_shift import modulate_scale_shift, modulate_scale_shift_ref, rows_guard

MAX_DIM = 6144  # 4 warps x 32 lanes x 12 four-element vectors held in registers (FLUX.2-dev: D = 6144)


def layernorm_scale_shift_ref(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The eager chain: ``norm(x) * (1 + scale[:, None]) + shift[:, None]`` in plain PyTorch (four kernels)."""
    return modulate_scale_shift_ref(norm(x), scale, shift)


def _norm_then_modulate(norm, x, scale, shift):
    # The FusedOp reference: eager LayerNorm, then the exact fused modulate (same numbers as the eager chain).
    return modulate_scale_shift(norm(x), scale, shift)


def _guard_tensors(x, scale, shift, check_pointers: bool = True, rows_dtype: torch.dtype | None = None) -> str | None:
    # rows_dtype None (the raw ops): fp32 scale/shift rows select the fp32 modulate, as bindings_norms.cpp does
    if rows_dtype is None:
        rows_dtype = torch.float32 if scale.dtype is torch.float32 else x.dtype
    reason = rows_guard(x, scale, shift, rows_dtype, check_pointers)
    if reason is not None:
        return reason
    if x.shape[2] > MAX_DIM:
        return f"D above {MAX_DIM}"
    if x.shape[0] * x.shape[1] > 2**31 - 1:
        return "too many rows"
    return None


def _norm_unfit(norm, x, kinds: tuple[type, ...]) -> str | None:
    """Why `norm` is not a LayerNorm of one of `kinds` over x's last dim without affine (the kernel's), or None."""
    if (type(norm) not in kinds or not _affine_free(norm) or x.dim() == 0
            or tuple(norm.normalized_shape) != (x.shape[-1],)):
        return "norm not a LayerNorm over the last dim without affine"
    return None


def _affine_free(norm) -> bool:
    """``norm.weight is None and norm.bias is None`` for a module of one of the LayerNorm classes taken (none defines
    either on the class): read from its ``_parameters``, where the two are registered (0.1 us; ``nn.Module``'s
    ``__getattr__`` takes 0.6 us for each), unless an instance attribute would shadow them or one is not there."""
    params, own = norm._parameters, norm.__dict__
    weight, bias = params.get("weight", params), params.get("bias", params)
    if weight is params or bias is params or "weight" in own or "bias" in own:
        return norm.weight is None and norm.bias is None
    return weight is None and bias is None


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    return _norm_unfit(norm, x, (torch.nn.LayerNorm,)) or _guard_tensors(x, scale, shift, check_pointers, x.dtype)


def _cuda_ops():
    load_extension()
    return torch.ops.diffusers_fastpath


# The NVRTC way (ops/_nvrtc.py): csrc/layernorm_scale_shift.cu's kernels, launched as its launch() and
# bindings_norms.cpp's layernorm_scale_shift_launch do: one block (32, 4) per row, of the kKv = _kv_for(D) kernel (the vectors each thread
# holds); the probe's kKv = 0, (32, 8) for its kEightWarps bit (64).
# Duplicated from there: those shapes and kv_for (tests/test_nvrtc.py checks them against the .cu), the
# LayerNormScaleShiftArgs fields (fastpath.h), the batch strides, eps as static_cast<float> (struct's 'f' rounds a
# Python float to nearest, the same) and the output allocation; the guard stands for bindings_norms.cpp's input checks.
_ARGS = _nvrtc.Params("LayerNormScaleShiftArgs", ("out", "P"), ("x", "P"), ("scale", "P"), ("shift", "P"),
                      ("batch", "q"), ("seq", "q"), ("dim", "q"), ("scale_batch_stride", "q"),
                      ("shift_batch_stride", "q"), ("eps", "f"), ("variant", "i"), ("probe", "?"), ("dtype", "i"),
                      ("modulate_fp32", "?"), ("affine", "?"), ("gated", "?"), ("x_out", "P"), ("gate", "P"),
                      ("update", "P"), ("gate_batch_stride", "q"), ("scale_seq_stride", "q"),
                      ("shift_seq_stride", "q"), ("norm_weight", "P"), ("norm_bias", "P"), ("row_index", "P"),
                      ("gate_index", "P"), ("tanh_gate", "?"))
_KVS = (0, 6, 8, 12)
_NVRTC = _nvrtc.Kernel(
    "layernorm_scale_shift.cu",
    "diffusers_fastpath::layernorm_scale_shift_kernel",
    {(dtype, rows, kv, gated): f"{_nvrtc.STORAGE_TYPE[dtype]}, "
     f"{'float' if rows is torch.float32 else _nvrtc.STORAGE_TYPE[dtype]}, {kv}, {str(gated).lower()}"
     for dtype in (torch.bfloat16, torch.float16) for rows in (dtype, torch.float32) for kv in _KVS
     for gated in (False, True) if not gated or (kv and rows is dtype)}  # gated: T's chain, production kernels
    # the gated form with the gate's tanh taken of each value (kTanhGate: Qwen-Image 2.1's indexed gate rows)
    | {(dtype, dtype, kv, "tanh"): f"{_nvrtc.STORAGE_TYPE[dtype]}, {_nvrtc.STORAGE_TYPE[dtype]}, {kv}, true, true"
       for dtype in (torch.bfloat16, torch.float16) for kv in _KVS[1:]},
    _nvrtc.Params("layernorm_scale_shift_kernel", ("a", _ARGS)),
)
_EIGHT_WARPS, _VARIANT_MASK = 64, 127
_ATEN_THREADS = 128


def _kv_for(dim: int) -> int:
    """csrc/layernorm_scale_shift.cu's kv_for: the instantiated vectors per aten thread that hold a row of `dim`."""
    per_thread = -(-(dim // 4) // _ATEN_THREADS)
    return next((kv for kv in _KVS[1:-1] if per_thread <= kv), _KVS[-1])


def _nvrtc_kernel(x, scale, shift, eps: float, variant: int = 0, probe: bool = False, out=None,
                  affine: bool = False, gate=None, update=None, x_out=None, seq_strides=(0, 0),
                  norm_weight=None, norm_bias=None, row_index=None, gate_index=None,
                  tanh_gate: bool = False) -> torch.Tensor:
    batch, seq, dim = x.shape
    if out is None:
        out = x.new_empty(x.shape)
    else:
        _nvrtc.check_out("layernorm_scale_shift", out, x.shape, x, 16)
    # x is the residual; x_out gets the gated update (gated_layernorm_scale_shift); gate_index: the gate an [R, dim]
    # table whose rows that index picks (gated_layernorm_scale_rows), its row stride the gate's batch stride below
    gated = update is not None
    if tanh_gate and gate_index is None:
        raise ValueError("layernorm_scale_shift: the gate's tanh needs an indexed gate")
    if gated:
        _nvrtc.check_out("gated_layernorm_scale_shift", x_out, x.shape, x, 16)
    if probe and variant & ~_VARIANT_MASK:
        raise ValueError(f"layernorm_scale_shift: no reduction variant {variant}")
    variant = variant if probe else 0
    device = x.device.index
    kv = 0 if probe else _kv_for(dim)
    block = (32, 8 if variant & _EIGHT_WARPS else 4, 1)
    fp32 = scale.dtype is torch.float32
    key = (x.dtype, scale.dtype, kv, "tanh" if tanh_gate else gated)
    _NVRTC.launch(device, key, (batch * seq, 1, 1), block, out.data_ptr(),
                  x.data_ptr(), scale.data_ptr(), 0 if shift is None else shift.data_ptr(), batch, seq, dim,
                  0 if scale.shape[0] == 1 else scale.stride(0),
                  0 if shift is None or shift.shape[0] == 1 else shift.stride(0), eps,
                  variant, probe, _nvrtc.DTYPE_CODE[x.dtype], fp32, affine, gated,
                  x_out.data_ptr() if gated else 0, gate.data_ptr() if gated else 0,
                  update.data_ptr() if gated else 0, 0 if not gated or gate.shape[0] == 1 else gate.stride(0),
                  *seq_strides, 0 if norm_weight is None else norm_weight.data_ptr(),
                  0 if norm_bias is None else norm_bias.data_ptr(), 0 if row_index is None else row_index.data_ptr(),
                  0 if gate_index is None else gate_index.data_ptr(), tanh_gate)
    return out


def _nvrtc_gated_kernel(residual, gate, update, scale, shift, eps: float, out=None):
    x_out, out = (residual.new_empty(residual.shape), residual.new_empty(residual.shape)) if out is None else out
    _nvrtc_kernel(residual, scale, shift, eps, out=out, gate=gate, update=update, x_out=x_out)
    return x_out, out


_nvrtc.raw_op("_layernorm_scale_shift_cuda", "(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor",
              lambda x, scale, shift, eps: _guard_tensors(x, scale, shift), _nvrtc_kernel)
_nvrtc.raw_op("_layernorm_scale_shift_cuda_out", "(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift, float eps) -> ()",
              lambda x, scale, shift, eps: _guard_tensors(x, scale, shift), _nvrtc_kernel, outs=1)
_nvrtc.raw_op("_layernorm_scale_shift_probe_cuda",
              "(Tensor x, Tensor scale, Tensor shift, float eps, int variant) -> Tensor",
              lambda x, scale, shift, eps, variant: _guard_tensors(x, scale, shift),
              lambda x, scale, shift, eps, variant: _nvrtc_kernel(x, scale, shift, eps, variant, probe=True))

_nvrtc.raw_op("_gated_layernorm_scale_shift_cuda",
              "(Tensor residual, Tensor gate, Tensor update, Tensor scale, Tensor shift, float eps) -> (Tensor, Tensor)",
              lambda residual, gate, update, scale, shift, eps: _gated_tensors_guard(residual, gate, update, scale, shift),
              _nvrtc_gated_kernel)
_nvrtc.raw_op("_gated_layernorm_scale_shift_cuda_out",
              "(Tensor(a!) x_out, Tensor(b!) out, Tensor residual, Tensor gate, Tensor update, Tensor scale, "
              "Tensor shift, float eps) -> ()",
              lambda residual, gate, update, scale, shift, eps: _gated_tensors_guard(residual, gate, update, scale, shift),
              _nvrtc_gated_kernel, outs=2)

_launch = LazyLauncher(_nvrtc_kernel, "_layernorm_scale_shift_cuda")


def _kernel(norm, x, scale, shift):
    return _launch(x, scale, shift, norm.eps)


@torch.library.custom_op("diffusers_fastpath::layernorm_scale_shift", mutates_args=())
def _layernorm_scale_shift_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    # What torch.compile runs: the kernel where the guard (with real pointers) allows, the eager chain elsewhere.
    if _guard_tensors(x, scale, shift) is None:
        return _cuda_ops()._layernorm_scale_shift_cuda.default(x, scale, shift, eps)
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return modulate_scale_shift_ref(y, scale, shift).contiguous()


@_layernorm_scale_shift_op.register_fake
def _(x, scale, shift, eps):
    torch._check(x.dim() == 3, lambda: f"layernorm_scale_shift: x must be [B, L, D], got {tuple(x.shape)}")
    torch._check(scale.dim() == 2 and shift.dim() == 2, lambda: "layernorm_scale_shift: scale/shift must be [B, D]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _signature(norm, x, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1])


LAYERNORM_SCALE_SHIFT = FusedOp(
    "layernorm_scale_shift",
    ref=_norm_then_modulate,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.layernorm_scale_shift.default(
        x, scale, shift, norm.eps
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def layernorm_scale_shift(norm, x, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]``, LayerNorm and modulate fused and bit-identical to eager.

    Args:
        norm: the ``torch.nn.LayerNorm`` (no affine) of the adaLN site; its ``eps`` is used, and it runs itself on
            fallback.
        x: ``[B, L, D]`` activations.
        scale, shift: ``[B, D]`` or ``[1, D]`` modulation rows (chunks of the adaLN linear's output).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import layernorm_scale_shift, layernorm_scale_shift_ref
        >>> norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        >>> x, emb = torch.randn(1, 16, 64), torch.randn(1, 6 * 64)
        >>> shift, scale = emb.chunk(6, dim=1)[:2]
        >>> torch.equal(layernorm_scale_shift(norm, x, scale, shift), layernorm_scale_shift_ref(norm, x, scale, shift))
        True
    """
    return LAYERNORM_SCALE_SHIFT(site, norm, x, scale, shift)


# --- the gated residual update and the LayerNorm-modulate of the new stream, in one pass ----------------------------


def gated_layernorm_scale_shift_ref(norm, residual, gate, update, scale, shift):
    """The eager chain: ``x = residual + gate * update``, then ``norm(x) * (1 + scale[:, None]) + shift[:, None]``;
    returns ``(x, that)``."""
    x = gated_residual_ref(residual, gate, update)
    return x, layernorm_scale_shift_ref(norm, x, scale, shift)


def _gated_fallback(norm, residual, gate, update, scale, shift):
    # the two fused ops, each exact on its own (and each with its own guard)
    x = gated_residual(residual, gate, update)
    return x, layernorm_scale_shift(norm, x, scale, shift)


def _gated_tensors_guard(residual, gate, update, scale, shift, check_pointers: bool = True) -> str | None:
    reason = (_guard_tensors(residual, scale, shift, check_pointers, residual.dtype)
              or residual_guard(residual, gate, update, residual.dtype, check_pointers))
    if reason is None and gate.shape[1] != 1:
        return "gate not one row per sample"
    return reason


def _gated_guard(norm, residual, gate, update, scale, shift, check_pointers: bool = True) -> str | None:
    return (_norm_unfit(norm, residual, (torch.nn.LayerNorm,))
            or _gated_tensors_guard(residual, gate, update, scale, shift, check_pointers))


_gated_launch = LazyLauncher(_nvrtc_gated_kernel, "_gated_layernorm_scale_shift_cuda")


def _gated_kernel(norm, residual, gate, update, scale, shift):
    return _gated_launch(residual, gate, update, scale, shift, norm.eps)


@torch.library.custom_op("diffusers_fastpath::gated_layernorm_scale_shift", mutates_args=())
def _gated_layernorm_scale_shift_op(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                                    scale: torch.Tensor, shift: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _gated_tensors_guard(residual, gate, update, scale, shift) is None:
        return _cuda_ops()._gated_layernorm_scale_shift_cuda.default(residual, gate, update, scale, shift, eps)
    x = gated_residual_ref(residual, gate, update).contiguous()
    y = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return x, modulate_scale_shift_ref(y, scale, shift).contiguous()


@_gated_layernorm_scale_shift_op.register_fake
def _(residual, gate, update, scale, shift, eps):
    torch._check(residual.dim() == 3, lambda: f"gated_layernorm_scale_shift: residual must be [B, L, D], got "
                 f"{tuple(residual.shape)}")
    like = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like)


GATED_LAYERNORM_SCALE_SHIFT = FusedOp(
    "gated_layernorm_scale_shift",
    ref=gated_layernorm_scale_shift_ref,
    guard=_gated_guard,
    kernel=_gated_kernel,
    custom_op=lambda norm, residual, gate, update, scale, shift: (
        torch.ops.diffusers_fastpath.gated_layernorm_scale_shift.default(residual, gate, update, scale, shift, norm.eps)
    ),
    verify_key=_signature,  # (dtype, D) of the residual, the row the statistics run over
    fallback=_gated_fallback,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def gated_layernorm_scale_shift(norm, residual, gate, update, scale, shift, site: Site | None = None):
    """``x = residual + gate * update`` and ``norm(x) * (1 + scale[:, None]) + shift[:, None]`` in one kernel,
    bit-identical to eager (FLUX's residual update followed by the next LayerNorm-modulate of the stream: a dual
    block's ``norm2``, or the next block's adaLN).

    The row is the gated residual update of `gated_residual` (its two rounding points), written out and kept in
    registers for the LayerNorm statistics and the modulate of `layernorm_scale_shift`; the op verifies itself
    against eager on its first call per (dtype, D), as that op does. Where the kernel cannot run, the two fused ops
    run one after the other.

    Args:
        norm: the ``torch.nn.LayerNorm`` (no affine) of the site.
        residual: ``[B, L, D]`` stream.
        gate: ``[B, 1, D]`` (or ``[1, 1, D]``) row per sample, such as diffusers' ``gate.unsqueeze(1)``.
        update: ``[B, L, D]`` branch output.
        scale, shift: ``[B, D]`` or ``[1, D]`` modulation rows.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Returns:
        ``(x, out)``: the new stream and its modulated norm.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import gated_layernorm_scale_shift, gated_layernorm_scale_shift_ref
        >>> norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        >>> residual, update, emb = torch.randn(1, 16, 64), torch.randn(1, 16, 64), torch.randn(1, 6 * 64)
        >>> shift, scale, gate = emb.chunk(6, dim=1)[:3]
        >>> args = (norm, residual, gate.unsqueeze(1), update, scale, shift)
        >>> all(map(torch.equal, gated_layernorm_scale_shift(*args), gated_layernorm_scale_shift_ref(*args)))
        True
    """
    return GATED_LAYERNORM_SCALE_SHIFT(site, norm, residual, gate, update, scale, shift)


# --- Wan's chain: an fp32 LayerNorm of the upcast stream and an fp32 modulate, one rounding --------------------------

_FP32_NORMS = (torch.nn.LayerNorm, FP32LayerNorm)  # on an fp32 input both are F.layer_norm in fp32


def layernorm_scale_shift_fp32_ref(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The eager chain of Wan's blocks: ``(norm(x.float()) * (1 + scale[:, None]) + shift[:, None]).type_as(x)`` with
    fp32 ``[B, D]`` scale/shift rows (diffusers writes ``(1 + scale_msa)`` of ``[B, 1, D]`` chunks: the same sums and
    products element by element)."""
    return (norm(x.float()) * (1 + scale[:, None]) + shift[:, None]).type_as(x)


def _guard_fp32(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    return _norm_unfit(norm, x, _FP32_NORMS) or _guard_tensors(x, scale, shift, check_pointers, torch.float32)


@torch.library.custom_op("diffusers_fastpath::layernorm_scale_shift_fp32", mutates_args=())
def _layernorm_scale_shift_fp32_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    if _guard_tensors(x, scale, shift, True, torch.float32) is None:
        return _cuda_ops()._layernorm_scale_shift_cuda.default(x, scale, shift, eps)
    y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (y * (1 + scale[:, None]) + shift[:, None]).to(x.dtype).contiguous()


@_layernorm_scale_shift_fp32_op.register_fake
def _(x, scale, shift, eps):
    torch._check(x.dim() == 3, lambda: f"layernorm_scale_shift_fp32: x must be [B, L, D], got {tuple(x.shape)}")
    torch._check(scale.dim() == 2 and shift.dim() == 2, lambda: "layernorm_scale_shift_fp32: scale/shift must be [B, D]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


LAYERNORM_SCALE_SHIFT_FP32 = FusedOp(
    "layernorm_scale_shift_fp32",
    ref=layernorm_scale_shift_fp32_ref,
    guard=_guard_fp32,
    kernel=_kernel,  # the raw op takes fp32 rows and runs this chain (csrc/layernorm_scale_shift.cu)
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.layernorm_scale_shift_fp32.default(
        x, scale, shift, norm.eps
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def layernorm_scale_shift_fp32(norm, x, scale, shift, site: Site | None = None) -> torch.Tensor:
    """``(norm(x.float()) * (1 + scale[:, None]) + shift[:, None]).type_as(x)`` (Wan's adaLN sites: an fp16/bf16
    stream, its fp32 LayerNorm, fp32 scale/shift rows), fused on CUDA and bit-identical to eager: the LayerNorm's
    statistics as `layernorm_scale_shift` computes them, its output and the modulate in fp32, one rounding. Verified
    against eager on its first call per (dtype, D), like `layernorm_scale_shift`.

    Args:
        norm: the ``torch.nn.LayerNorm`` or diffusers ``FP32LayerNorm`` (no affine) of the site.
        x: ``[B, L, D]`` activations of fp16 or bf16 for the kernel.
        scale, shift: float32 ``[B, D]`` or ``[1, D]`` rows (16-byte aligned; any batch stride of 4 floats).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LAYERNORM_SCALE_SHIFT_FP32(site, norm, x, scale, shift)


# --- Wan's norm2: an FP32LayerNorm with weight and bias of the upcast stream, rounded once -----------------------------


def layernorm_affine_fp32_ref(norm, x: torch.Tensor) -> torch.Tensor:
    """The eager chain of Wan's ``norm2``: ``norm(x.float()).type_as(x)``, an ``FP32LayerNorm`` with weight and bias
    (``F.layer_norm`` in fp32 with ``weight.float()`` and ``bias.float()``)."""
    return norm(x.float()).type_as(x)


def _guard_affine(norm, x, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs: an ``FP32LayerNorm`` over x's last dim with ``[D]`` weight and
    bias on x's device (the kernel reads D of each), the layout checks of `_guard_tensors`, no autograd."""
    if (type(norm) is not FP32LayerNorm or norm.weight is None or norm.bias is None or x.dim() == 0
            or tuple(norm.normalized_shape) != (x.shape[-1],) or norm.weight.shape != x.shape[-1:]
            or norm.bias.shape != x.shape[-1:]):
        return "norm not an FP32LayerNorm over the last dim with weight and bias"
    if torch.is_grad_enabled() and (norm.weight.requires_grad or norm.bias.requires_grad or x.requires_grad):
        return "requires grad"
    if norm.weight.device != x.device or norm.bias.device != x.device:
        return "devices differ"
    row = x.new_empty((1, x.shape[-1]), dtype=torch.float32)  # the kernel's weight.float() and bias.float(): new rows
    return _guard_tensors(x, row, row, check_pointers, torch.float32)


def _nvrtc_affine(x, weight, bias, eps: float) -> torch.Tensor:
    return _nvrtc_kernel(x, weight[None], bias[None], eps, affine=True)


def _raw_affine_guard(x, weight, bias, eps):
    if weight.dim() != 1 or bias.dim() != 1:
        return "weight and bias must be [dim] vectors"
    return _guard_tensors(x, weight[None], bias[None])


_nvrtc.raw_op("_layernorm_affine_fp32_cuda", "(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor",
              _raw_affine_guard, _nvrtc_affine)

_affine_launch = LazyLauncher(_nvrtc_affine, "_layernorm_affine_fp32_cuda")


def _kernel_affine(norm, x):
    return _affine_launch(x, norm.weight.float(), norm.bias.float(), norm.eps)  # as FP32LayerNorm.forward passes them


@torch.library.custom_op("diffusers_fastpath::layernorm_affine_fp32", mutates_args=())
def _layernorm_affine_fp32_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    weight, bias = weight.float(), bias.float()
    if _raw_affine_guard(x, weight, bias, eps) is None:
        return _cuda_ops()._layernorm_affine_fp32_cuda.default(x, weight, bias, eps)
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(x.dtype).contiguous()


@_layernorm_affine_fp32_op.register_fake
def _(x, weight, bias, eps):
    torch._check(x.dim() == 3, lambda: f"layernorm_affine_fp32: x must be [B, L, D], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


LAYERNORM_AFFINE_FP32 = FusedOp(
    "layernorm_affine_fp32",
    ref=layernorm_affine_fp32_ref,
    guard=_guard_affine,
    kernel=_kernel_affine,
    custom_op=lambda norm, x: torch.ops.diffusers_fastpath.layernorm_affine_fp32.default(
        x, norm.weight, norm.bias, norm.eps
    ),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def layernorm_affine_fp32(norm, x, site: Site | None = None) -> torch.Tensor:
    """``norm(x.float()).type_as(x)`` (Wan's ``norm2``: an ``FP32LayerNorm`` with weight and bias of an fp16/bf16
    stream), fused on CUDA and bit-identical to eager: the LayerNorm's statistics as `layernorm_scale_shift_fp32`
    computes them, aten's affine epilogue ``fma(weight, y, bias)`` in fp32, one rounding. Verified against eager on
    its first call per (dtype, D), like `layernorm_scale_shift`.

    Args:
        norm: the ``FP32LayerNorm`` of the site, with weight and bias (any dtype: upcast as its forward does).
        x: ``[B, L, D]`` activations of fp16 or bf16 for the kernel.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LAYERNORM_AFFINE_FP32(site, norm, x)
