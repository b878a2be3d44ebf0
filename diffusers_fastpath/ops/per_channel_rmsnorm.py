"""LTX-2's VAE norm (diffusers' ``PerChannelRMSNorm``: ``norm1`` / ``norm2`` of every ``LTX2VideoResnetBlock3d``, the
encoder's and the decoder's ``norm_out``), optionally followed by the SiLU after it (the resnets' ``nonlinearity``,
the ``conv_act`` after ``norm_out``), with everything after aten's mean in one pass, bit-identical to eager.

The module computes, for bf16/fp16/fp32 x of ``[B, C, *]`` (T its dtype, fp32 arithmetic, ``round`` to nearest even
in T where eager writes a tensor; nothing to round for fp32)::

    m   = torch.mean(x**2, dim=1, keepdim=True)   # aten's square and reduction, kept as eager runs them
    a   = round(m + eps)                          # ``mean_sq + self.eps``: a python number (see below)
    r   = round(sqrt(a))                          # ``torch.sqrt``: IEEE sqrtf in fp32 opmath
    y   = round(x / r)                            # ``x / rms``: div_true of two tensors, IEEE a / b in fp32 opmath
    out = round(y / (1 + exp(-y)))                # the SiLU module after it (the pair), aten's silu_kernel

Eager runs the add and the sqrt over ``[B, 1, *]`` (1/C of x), the division and the SiLU over the whole tensor;
``csrc/per_channel_rmsnorm.cu`` reads x and the mean once and writes once, each thread computing r once for its
positions and dividing eight channels by it. The square and the mean stay aten's own calls on x as the module makes
them (the same kernels, the same reduction order: the same bits).

Why it is exact. The division is one IEEE operation rounded where eager's result is rounded (``__fdiv_rn``; the build
passes ``--fmad=false`` and no product feeds an add anywhere in the tail, so nothing can contract): exact by
construction. ``r`` and the SiLU are each a function of one value (the position's mean, the element's y), and each is
proven on every value of the dtype on the device before the op is trusted (`_unary_proof`, the kernel's probe modes 2
and 1: all 65536 bf16 / fp16 values on the first call of a signature, all 2^32 fp32 bit patterns in chunks once per
device and eps): the SiLU is aten's expression with CUDA's ``expf`` (the proof `channel_rmsnorm_silu` runs for its
own kernel); ``r``'s add and sqrt are IEEE operations (``__fadd_rn``, ``__fsqrt_rn``; aten's ``self + alpha * other``
with ``alpha`` 1 rounds once whether or not nvcc contracted it; aten's half-precision ``sqrt`` is ``sqrtf`` of the
float rounded to T, and were it a correctly rounded T root it would be the same: rounding twice through fp32 is
innocuous for a square root, 24 >= 2 * 11 + 2), so the proof is a second line there, except for one question it
settles: how aten takes the python ``eps``. On CUDA the scalar stays a CPU double that the kernel casts to float
(``TensorIterator::compute_types`` makes dtype temporaries for CPU kernels only; ``scalar_value<opmath_t>``), what
this kernel is given; on a CPU it is first rounded to T (1e-8 is 1.0012e-8 in bf16: 334 of the bf16 means add
differently), which `eps_as_added` follows for the CPU arithmetic. fp32 (an fp32 VAE): the same IEEE operations on
fp32 tensors, nothing rounded between them in eager (each op's fp32 result is what the next reads) or here, the eps
cast to float either way. The first call of each signature is compared with eager too (`verify_key`), as the
self-verified ops do; a mismatch, or a failed proof, disables the op for the process (one warning) and eager runs.

What the guard admits: a module of a class registered with `add_norm_class` (diffusers' ``PerChannelRMSNorm`` after
its ``forward`` was checked by source digest, `diffusers_fastpath.models.vae_ltx2_norm.norm_fits`, or this package's
subclass of it) whose ``channel_dim`` is 1 and ``eps`` a python number; a bf16/fp16/fp32 x of at least 2 dims,
not empty, whose trailing dims are contiguous and whose channels and batches are nested outside them, possibly apart
(``x.stride()`` that of a contiguous tensor, or of one with frames sliced off: an upsampler's ``[:, :, 1:]``), for
which eager's results are contiguous, as the kernel's are; no autograd; on CUDA. 16-byte vectors where the trailing
size, both strides and the pointers are multiples of 16 bytes, else one element per thread (each way its own
signature, as far as sizes and strides decide it: `_signature`). The pair `per_channel_rmsnorm_silu` stands for the norm's call: hooks on the norm refuse it (``modules``),
and its fallback calls the module, so they run. Anything else runs the module's forward as diffusers wrote it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import (FLOAT_DTYPES, HALF_DTYPES, EagerClasses, FusedOp, Site, autograd_device_reason,
                      tensor_reason)
from ._unary_proof import prove_every_value, prove_fp32

_VEC_BYTES = 16
_THREADS, _BLOCKS_PER_SM, _CHANNELS = 256, 8, 8  # csrc/per_channel_rmsnorm.cu's kThreads, kBlocksPerSm, kChannels
PROBE_SILU, PROBE_RMS = 1, 2  # the kernel's probe modes (fastpath.h's PerChannelRmsNormArgs.probe)
_EXACT_IN_DOUBLE = 2**53  # an int eps beyond this would be rounded twice on its way to float

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one
# ``add_norm_class(cls, base=None)`` lets the guard take modules of `cls`: diffusers' ``PerChannelRMSNorm`` (`base`
# None) once its ``forward`` was checked to be the norm documented above (`vae_ltx2_norm.norm_fits`), or this package's
# subclass of `base` that adds no state and whose forward runs this op
add_norm_class = _BASES.add


def per_channel_rmsnorm_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: the diffusers class's ``forward`` (so that a subclass whose forward runs this op falls back to
    diffusers' code, not to itself)."""
    return _BASES.eager(norm).forward(norm, x)


def per_channel_rmsnorm_silu_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager pair: the norm, then ``F.silu`` (an ``nn.SiLU`` module's forward)."""
    return F.silu(per_channel_rmsnorm_ref(norm, x))


def _pair_fallback(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the pair runs where the kernel does not: the norm module's call (its hooks run), then ``F.silu``."""
    return F.silu(norm(x))


def _is_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, float) or abs(v) <= _EXACT_IN_DOUBLE


def channel_strides(x: torch.Tensor) -> tuple[int, int] | None:
    """``(batch stride, channel stride)`` of a ``[B, C, *]`` x that the kernel reads and whose eager result is
    contiguous, else ``None``: the trailing dims exactly a contiguous tensor's (size-1 ones included), the channels
    at least the trailing size apart and the batches at least C channels apart (a contiguous x, or one with frames
    sliced off). aten lays the result of ``x / rms`` (and of the SiLU of it) out contiguous then: TensorIterator orders
    the dims by x's strides, which decrease from the batch to the last dim, ties only where the inner dim has size 1,
    which it never swaps outward."""
    expected = 1
    for d in range(x.dim() - 1, 1, -1):
        if x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    batch_stride, channel_stride = x.stride(0), x.stride(1)
    if channel_stride < expected or batch_stride < x.shape[1] * channel_stride:
        return None
    return batch_stride, channel_stride


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(norm, "per-channel RMS norm")
    if reason is not None:
        return reason
    channel_dim = getattr(norm, "channel_dim", None)
    if type(channel_dim) is not int or channel_dim != 1:
        return "channel_dim not 1"
    if not _is_number(getattr(norm, "eps", None)):
        return "eps not a python number"
    reason = tensor_reason(x, FLOAT_DTYPES, 2, "[B, C, *]")
    if reason is not None:
        return reason
    if x.numel() == 0:
        return "empty"
    if channel_strides(x) is None:
        return "x's layout: trailing dims not contiguous or channels not nested"
    return autograd_device_reason(x)


def eps_as_added(eps, dtype: torch.dtype, device: torch.device) -> float:
    """The value eager's ``mean_sq + eps`` adds (in fp32 opmath), as a python float whose cast to float is it. On CUDA
    the python scalar's double (an int's exact double) cast to float: aten's CUDA add reads the CPU scalar as it is
    (``scalar_value<opmath_t>``); the kernel is given this. On a CPU, TensorIterator first makes the scalar a tensor of
    the common dtype T (bf16's 1e-8 is 1.0012e-8): the CPU arithmetic's value (the tests' emulated kernel, the custom
    op's CPU path)."""
    if device.type == "cpu" and dtype in HALF_DTYPES:
        return float(torch.tensor(eps).to(dtype))
    return float(eps)


def per_channel_rmsnorm_arithmetic(x: torch.Tensor, mean: torch.Tensor, eps: float, silu: bool) -> torch.Tensor:
    """The kernel's arithmetic in torch (each step rounded to x's dtype where the kernel rounds) for x ``[B, C, *]``
    and its ``[B, 1, *]`` mean, `eps` as `eps_as_added` gives it: what the tests' emulated kernels run on a CPU, and
    the documentation of ``csrc/per_channel_rmsnorm.cu`` in code. The square root is ``torch.sqrt`` of the rounded
    sum, aten's on x's device: on CUDA ``sqrtf`` of its float rounded to T, the kernel's ``__fsqrt_rn`` (proven on
    every value); a CPU's is its own (its fp32 sqrt is not correctly rounded: ``sqrt(1 - 2**-11)`` comes out one ulp
    high, so ``torch.sqrt(a.float()).to(T)`` would give 15 fp16 means another root than the CPU's fp16 sqrt and
    CUDA's)."""
    dtype = x.dtype
    a = (mean.float() + torch.tensor(eps, dtype=torch.float32)).to(dtype)
    r = torch.sqrt(a)
    y = (x.float() / r.float()).to(dtype)
    return F.silu(y) if silu else y


# The NVRTC way (ops/_nvrtc.py): csrc/per_channel_rmsnorm.cu's kernel, launched as its launch() and bindings.cpp's
# per_channel_rmsnorm do. Duplicated from there: the PerChannelRmsNormArgs fields (fastpath.h), the output allocation,
# the choice of vectors or elements and the grid (one thread per kChannels channels of a vector, at most kBlocksPerSm
# blocks per SM); the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("PerChannelRmsNormArgs", ("out", "P"), ("x", "P"), ("mean", "P"), ("batch", "q"),
                      ("channels", "q"), ("spatial", "q"), ("x_batch_stride", "q"), ("x_channel_stride", "q"),
                      ("eps", "f"), ("silu", "i"), ("probe", "i"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel("per_channel_rmsnorm.cu", "diffusers_fastpath::per_channel_rmsnorm_kernel",
                       {(dtype, vector): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(vector).lower()}"
                        for dtype in FLOAT_DTYPES for vector in (True, False)},
                       _nvrtc.Params("per_channel_rmsnorm_kernel", ("a", _ARGS)))


def _raw_guard(x, mean, eps, silu, probe):
    if x.dim() != 3 or x.dtype not in FLOAT_DTYPES or (x.shape[2] > 1 and x.stride(2) != 1):
        return "x"
    if probe not in (0, PROBE_SILU, PROBE_RMS) or (probe and silu):
        return "probe"
    if not probe and (mean is None or mean.dtype != x.dtype or not mean.is_contiguous()
                      or mean.numel() != x.shape[0] * x.shape[2]):
        return "mean"
    if not x.is_cuda or (not probe and mean.device != x.device):
        return "device"
    return None


def vectors(x: torch.Tensor, mean: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether the kernel runs 16-byte vectors over x ``[B, C, S]`` (its launch()'s choice): S, both strides and the
    pointers multiples of 16 bytes; else one element per thread."""
    vec = _VEC_BYTES // x.element_size()
    return (x.shape[2] % vec == 0 and x.stride(1) % vec == 0 and x.stride(0) % vec == 0
            and x.data_ptr() % _VEC_BYTES == 0 and out.data_ptr() % _VEC_BYTES == 0
            and (mean is None or mean.data_ptr() % _VEC_BYTES == 0))


def _nvrtc_kernel(x, mean, eps, silu, probe):
    batch, channels, spatial = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    vector = vectors(x, mean, out)
    items = batch * -(-channels // _CHANNELS) * (spatial // (_VEC_BYTES // x.element_size()) if vector else spatial)
    if items == 0:
        return out
    device = x.device.index
    blocks = _nvrtc.grid_stride_blocks(device, items, _THREADS, _BLOCKS_PER_SM)
    _NVRTC.launch(device, (x.dtype, vector), (blocks, 1, 1), (_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  0 if probe else mean.data_ptr(), batch, channels, spatial, x.stride(0), x.stride(1), eps, int(silu),
                  int(probe), _nvrtc.DTYPE_CODE[x.dtype])
    return out


_nvrtc.raw_op("_per_channel_rmsnorm_cuda", "(Tensor x, Tensor? mean, float eps, bool silu, int probe) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_per_channel_rmsnorm_cuda")  # (x, mean, eps, silu, probe)


def _fused(x: torch.Tensor, eps, silu: bool) -> torch.Tensor:
    """The kernel over x's memory as ``[B, C, S]`` (its strides: channels and batches possibly apart), after eager's
    own square and mean (``[B, 1, *]``, read as ``[B, S]``); the result contiguous, as eager's is
    (`channel_strides`)."""
    mean = torch.mean(x**2, dim=1, keepdim=True)  # the module's own two calls: aten's kernels, aten's order
    batch, channels = x.shape[:2]
    out = _launch(x.reshape(batch, channels, -1), mean.reshape(batch, -1).contiguous(),
                  eps_as_added(eps, x.dtype, x.device), silu, 0)
    return out.view(x.shape)


def _kernel(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps, False)


def _kernel_silu(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps, True)


def _signature(norm, x: torch.Tensor):
    """What one first-call ``torch.equal`` (and the proofs) vouch for: the dtype, whether the kernel runs vectors or
    elements as far as x's sizes and strides decide it (what torch.compile can read of a traced x; an x at an offset of
    no multiple of 16 bytes runs elements under the vectors' key: the proofs cover both ways, and the division is exact
    by construction either way), and the eps (the proofs' r depends on it)."""
    vec = _VEC_BYTES // x.element_size()
    batch_stride, channel_stride = channel_strides(x)
    vector = math.prod(x.shape[2:]) % vec == 0 and channel_stride % vec == 0 and batch_stride % vec == 0
    return str(x.dtype).removeprefix("torch."), "vectors" if vector else "elements", float(norm.eps)


_FP32_PROVEN: set = set()  # (device, what) where an fp32 proof passed: ("silu",) or ("rms", eps)


def _probe(mode: int, eps: float = 0.0):
    return lambda row: _launch(row, None, eps, False, mode)


def _prove_rms(norm, x: torch.Tensor) -> bool:
    """The kernel's ``round(sqrt(round(m + eps)))`` equals eager's ``torch.sqrt(m + eps)`` for every value m of the
    dtype (every fp32 bit pattern: `_unary_proof.prove_fp32`, once per device and eps), both ways it runs."""
    eps = norm.eps
    probe = _probe(PROBE_RMS, eps_as_added(eps, x.dtype, x.device))

    def ref(m):
        return torch.sqrt(m + eps)

    return prove_every_value(x, probe, ref, _FP32_PROVEN, (x.device, "rms", float(eps)),
                             lambda device: prove_fp32(device, probe, ref))


def _prove_rms_silu(norm, x: torch.Tensor) -> bool:
    """`_prove_rms`, and the kernel's SiLU equals eager's ``F.silu`` on every value of the dtype (once per device for
    fp32's 2^32)."""
    probe = _probe(PROBE_SILU)
    return _prove_rms(norm, x) and prove_every_value(x, probe, F.silu, _FP32_PROVEN, (x.device, "silu"),
                                                     lambda device: prove_fp32(device, probe))


@torch.library.custom_op("diffusers_fastpath::per_channel_rmsnorm", mutates_args=())
def _per_channel_rmsnorm_op(x: torch.Tensor, eps: float, silu: bool) -> torch.Tensor:
    # What torch.compile runs: the kernel (the caller's guard admitted these inputs; torch.compile emits this op only
    # for signatures already verified and proven, see FusedOp); the arithmetic elsewhere.
    if x.is_cuda:
        return _fused(x, eps, silu)
    return per_channel_rmsnorm_arithmetic(x, torch.mean(x**2, dim=1, keepdim=True),
                                          eps_as_added(eps, x.dtype, x.device), silu)


@_per_channel_rmsnorm_op.register_fake
def _(x, eps, silu):
    torch._check(x.dim() >= 2, lambda: f"per_channel_rmsnorm: x must be [B, C, *], got {tuple(x.shape)}")
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # eager's layout (`channel_strides`)


def _custom(silu: bool):
    def call(norm, x):
        return torch.ops.diffusers_fastpath.per_channel_rmsnorm.default(x, float(norm.eps), silu)
    return call


PER_CHANNEL_RMSNORM = FusedOp("per_channel_rmsnorm", ref=per_channel_rmsnorm_ref, guard=_guard, kernel=_kernel,
                              custom_op=_custom(False), verify_key=_signature, prove=_prove_rms)
PER_CHANNEL_RMSNORM_SILU = FusedOp("per_channel_rmsnorm_silu", ref=per_channel_rmsnorm_silu_ref, guard=_guard,
                                   kernel=_kernel_silu, custom_op=_custom(True), verify_key=_signature,
                                   prove=_prove_rms_silu, fallback=_pair_fallback,
                                   modules=(0,))  # the norm whose call the pair stands for: its hooks refuse it


def per_channel_rmsnorm(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for LTX-2's VAE norm: aten's square and mean, then the rest in one pass on CUDA, bit-identical to
    eager everywhere (the division exact by construction, ``sqrt(m + eps)`` proven on every value of the dtype).

    Args:
        norm: the norm module (diffusers' ``PerChannelRMSNorm``, registered by `add_norm_class`), whose forward this
            is (its hooks have run: the module's own call).
        x: ``[B, C, *]`` activations (the resnets' ``[B, C, T, H, W]``).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return PER_CHANNEL_RMSNORM(site, norm, x)


def per_channel_rmsnorm_silu(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``F.silu(norm(x))`` (the norm and the ``nn.SiLU`` module after it) in one pass after aten's square and mean,
    bit-identical to eager everywhere (the SiLU proven on every value of the dtype on first use). It stands for the
    norm's call: a norm with hooks refuses it and ``F.silu(norm(x))`` runs; the SiLU module's hooks are the caller's
    to check (as `diffusers_fastpath.models.vae.PairCalls` does).

    Args:
        norm: the norm module of the site.
        x: ``[B, C, *]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return PER_CHANNEL_RMSNORM_SILU(site, norm, x)
