"""LTX-2's VAE norm (diffusers' ``PerChannelRMSNorm``: ``norm1`` / ``norm2`` of every ``LTX2VideoResnetBlock3d``, the
encoder's and the decoder's ``norm_out``), optionally followed by the SiLU after it (the resnets' ``nonlinearity``,
the ``conv_act`` after ``norm_out``), in one kernel from x on, aten's channel mean included, bit-identical to eager.

The module computes, for bf16/fp16/fp32 x of ``[B, C, *]`` (T its dtype, fp32 arithmetic, ``round`` to nearest even
in T where eager writes a tensor; nothing to round for fp32)::

    q   = round(x * x)                            # ``x**2``: aten's pow with exponent 2
    m   = round(sum_c(q) * factor)                # ``torch.mean(q, dim=1, keepdim=True)``: aten's reduce kernel
    a   = round(m + eps)                          # ``mean_sq + self.eps``: a python number (see below)
    r   = round(sqrt(a))                          # ``torch.sqrt``: IEEE sqrtf in fp32 opmath
    y   = round(x / r)                            # ``x / rms``: div_true of two tensors, IEEE a / b in fp32 opmath
    out = round(y / (1 + exp(-y)))                # the SiLU module after it (the pair), aten's silu_kernel

Eager reads x and writes q (the square), reads q (the mean), runs the add and the sqrt over ``[B, 1, *]`` and the
division and the SiLU over the whole tensor. ``csrc/per_channel_rmsnorm.cu``'s fused kernel reads x for the
statistics, reads it again for the tail (a block takes one tile of positions through both, so the second read finds
it in L1 / L2 as a rule) and writes once. Where aten's order of the mean is not the one reproduced (`mean_order` says
why, `MEAN_FALLBACKS` counts it), the op runs aten's own square and mean, as the module does, and the file's first
kernel the rest (reading x and the mean once, writing once).

Why the statistics are exact (aten read in torch 2.13's ``Reduce.cuh``, ``SharedReduceOps.h``, ``PowKernel.cu``,
``ReduceMomentKernel.cu``; the GPU's torch 2.11 is held to it by the first-call comparison and the GPU tests' mean
probe). ``x**2`` is ``pow_tensor_scalar_kernel_impl`` with exponent 2: ``base * base`` in T, the float product of two
bf16/fp16 values exact (8 + 8, 11 + 11 significant bits < 24) and rounded once to T, the kernel's
``round(__fmul_rn(x, x))`` (fp32: the one IEEE product). ``torch.mean`` on CUDA is ``mean_kernel_cuda``:
``mean_kernel_impl<T, float>`` for bf16 and fp16 (``gpu_reduce_kernel<T, T, vt0 = 4, input_vec_size = 8>``; the
input vectors serve reductions along the fastest dim only), ``<float>`` for fp32 (vt0 4; newer builds take vt0 8 for
fp32 reductions over a multiple of 1024 values, so fp32 with C % 1024 == 0 keeps aten's mean); ``MeanOps`` adds
``acc + float(q)`` from 0 (``reduce`` and ``combine`` an add each) and projects ``acc * factor`` in float, rounded to
T, with ``factor = float(B S) / (B C S)`` computed in float on the host (`mean_factor`; 1/C exactly for C a power of
two). The launch (`aten_reduce_config`: `_aten_reduce`'s port of ``setReduceConfig``, for this iterator): q is laid out
contiguous (pow's output follows x's strides, which the guard admits only in dense [B, C, *] order), its iterator
puts the reduced dim first and coalesces the spatial ones: ``[C, S, B]`` (``[C, S]`` for B = 1), input strides
``S, 1, C S``, output ``0, 1, S``; for S >= 2 and C >= 2 the reduction is not on the fastest-striding dim, so block.x
maps the outputs, vectorised by ``output_vec_size`` ovs = 4, 2 or 1 (the largest dividing S, C S and q's pointer:
a fresh q from the caching allocator starts 512-byte aligned); ``set_block_dimension(B S / ovs, C)`` with 512 / ovs
threads: width = min(p2(B S / ovs), 32), height = min(p2(C), threads / width), width = min(p2(B S / ovs), threads /
height), p2(n) the largest power of two <= n, capped at the thread count; ``values_per_thread`` = C >= min(16 height,
256) splits the channels across the block's rows (``input_mult[1]``: rows = height, row y starting at channel y,
combined by ``block_y_reduce``), else rows = 1 (a thread sums all C); with the split, ceil(C / height) >= 256 and the
grid ceil(B S / ovs / step_output) <= SMs * (threads per SM // threads), the channels also split across
``ctas = max(min(ceil(target / grid), ceil(vpt / 16)), ceil(vpt / 256))`` blocks (vpt = ceil(C / height); block g
starting at channel g rows; ``global_reduce``). The SMs and threads per SM are read from x's device as aten reads
them (``getCurrentDeviceProperties`` under the op's device guard), so `mean_order` derives the order per device. Each
of the P = rows x ctas threads of an output then adds its channels j, j + P, ... (thread_reduce_impl, vt0 = 4: the
k-th into accumulator k % 4, four at a time, the tail into the first ones) and combines ((a0 + a1) + a2) + a3; a
block's rows combine by ``v_y += v_(y + off)`` for off = rows / 2 .. 1; with ctas > 1 the last block's row y adds,
from 0, the blocks' results y, y + rows, ... in order, and the rows combine by the same tree; then ``* factor``. The
fused kernel does exactly these float operations in this order (each add a ``__fadd_rn``, the product a
``__fmul_rn``, --fmad=false), with its own threads (`channel_mean_arithmetic` is the same in torch).
Every shape of LTX-2's decoder at 768x512x121 (bf16, latents [1, 128, 16, 16, 24]; 132 SMs of 2048 threads, an H100
or H200): C = 128 (S = 121 x 128 x 192), 256 (61 x 64 x 96), 512 (31 x 32 x 48): ovs 4, 32 x 4 threads, C >= 64:
rows 4, at most 128 values per row: ctas 1; C = 1024 (16 x 16 x 24): rows 4, 256 values per row, grid 48 <= 2112:
ctas max(min(44, 16), 1) = 16 (16 on any GPU of at least 46 such SMs). The encoder's: C = 128 .. 512 rows 4, ctas 1;
C = 1024 at 31 x 32 x 48: ctas 6; C = 2048 at 16 x 16 x 24: ctas 32. Where aten takes another order, or one not
read here, the op keeps aten's square and mean: S = 1 or C = 1 (other iterators), q beyond 32-bit indexing (aten
splits the iterator and carries partial sums between the parts), fp32 with C % 1024 == 0, more partial sums than
the kernel's scratch holds (a large C at a tiny S), more than 65535 batches.

Why the rest is exact. The division is one IEEE operation rounded where eager's result is rounded (``__fdiv_rn``; the
build passes ``--fmad=false`` and no product feeds an add anywhere in the tail, so nothing can contract): exact by
construction. ``r`` and the SiLU are each a function of one value (the position's mean, the element's y), and each is
proven on every value of the dtype on the device before the op is trusted (`_unary_proof`, the first kernel's probe
modes 2 and 1, whose device functions the fused kernel shares: all 65536 bf16 / fp16 values on the first call of a
signature, all 2^32 fp32 bit patterns in chunks once per device and eps): the SiLU is aten's expression with CUDA's
``expf`` (the proof `channel_rmsnorm_silu` runs for its own kernel); ``r``'s add and sqrt are IEEE operations
(``__fadd_rn``, ``__fsqrt_rn``; aten's ``self + alpha * other`` with ``alpha`` 1 rounds once whether or not nvcc
contracted it; aten's half-precision ``sqrt`` is ``sqrtf`` of the float rounded to T, and were it a correctly rounded
T root it would be the same: rounding twice through fp32 is innocuous for a square root, 24 >= 2 * 11 + 2), so the
proof is a second line there, except for one question it settles: how aten takes the python ``eps``. On CUDA the
scalar stays a CPU double that the kernel casts to float (``TensorIterator::compute_types`` makes dtype temporaries
for CPU kernels only; ``scalar_value<opmath_t>``), what this kernel is given; on a CPU it is first rounded to T (1e-8
is 1.0012e-8 in bf16: 334 of the bf16 means add differently), which `eps_as_added` follows for the CPU arithmetic.
fp32 (an fp32 VAE): the same IEEE operations on fp32 tensors, nothing rounded between them in eager (each op's fp32
result is what the next reads) or here, the eps cast to float either way. The first call of each signature (the
dtype, vectors or elements, the eps, and the mean's order: C, rows and ctas, or aten's own) is compared with eager too
(`verify_key`), as the self-verified ops are; a mismatch, or a failed proof, disables the op for the process (one
warning) and eager runs.

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

import functools
import math
import struct
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._aten_reduce import ReduceConfig, div_up, last_pow2, set_reduce_config
from ._build import LazyLauncher
from ._policy import (FLOAT_DTYPES, HALF_DTYPES, EagerClasses, FusedOp, Site, autograd_device_reason,
                      tensor_reason)
from ._unary_proof import prove_every_value, prove_fp32

_VEC_BYTES = 16
_THREADS, _BLOCKS_PER_SM, _CHANNELS = 256, 8, 8  # csrc/per_channel_rmsnorm.cuh's kThreads, kBlocksPerSm, kChannels
PROBE_SILU, PROBE_RMS = 1, 2  # the kernel's probe modes (fastpath.h's PerChannelRmsNormArgs.probe)
PROBE_MEAN = 3  # the fused kernel's probe mode: aten's mean alone, [B, S] (csrc/per_channel_rmsnorm.cuh's kProbeMean)
# csrc/per_channel_rmsnorm.cuh's kFusedThreads, kUnitThreads, kChainPartials, kSharedFloats and
# kMinBlocksPerSm
_FUSED_THREADS, _UNIT_THREADS, _CHAIN_PARTIALS, _SHARED_FLOATS, _MIN_BLOCKS_PER_SM = 256, 32, 8, 4096, 2
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


def module_reason(norm) -> str | None:
    """Why the kernels cannot stand for `norm`'s forward (or ``None``): a module of a registered class, its
    ``channel_dim`` 1 and its ``eps`` a python number."""
    reason = _BASES.refusal(norm, "per-channel RMS norm")
    if reason is not None:
        return reason
    channel_dim = getattr(norm, "channel_dim", None)
    if type(channel_dim) is not int or channel_dim != 1:
        return "channel_dim not 1"
    if not _is_number(getattr(norm, "eps", None)):
        return "eps not a python number"
    return None


def _guard(norm, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = module_reason(norm)
    if reason is not None:
        return reason
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


# --- aten's order of the channel mean -------------------------------------------------------------------------------


def aten_reduce_config(batch: int, channels: int, spatial: int, sms: int, threads_per_sm: int) -> ReduceConfig:
    """aten's ``setReduceConfig`` (`_aten_reduce.set_reduce_config`) for ``torch.mean(q, dim=1)`` of a contiguous q
    ``[B, C, S]`` with S >= 2 and C >= 2: the iterator ``[C, S, B]`` (input strides S, 1, C S; output 0, 1, S) reduces
    a dim that is not the fastest-striding one, so the outputs are vectorised (``get_output_vec_size``: the largest of
    4, 2, 1 dividing S, as q's pointer is aligned), block.x maps them; `sms` and `threads_per_sm` are the device's
    ``multiProcessorCount`` and ``maxThreadsPerMultiProcessor``."""
    vec = 4
    while spatial % vec:  # the pointer (aligned), shape[1] = S, the strides S and C S
        vec //= 2
    return set_reduce_config(batch * spatial, channels, False, sms, threads_per_sm, output_vec_size=vec)


def _float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def mean_factor(batch: int, channels: int, spatial: int) -> float:
    """``mean_kernel_impl``'s ``static_cast<float>(num_output_elements) / numel``: the int64 numel converted to float,
    one float division (a double quotient of two floats rounded to float is the float quotient: 53 >= 2 * 24 + 2)."""
    return _float32(_float32(batch * spatial) / _float32(batch * channels * spatial))


class MeanOrder(NamedTuple):
    """aten's order of a position's channel mean (csrc/per_channel_rmsnorm.cuh's comment): `rows` partial sums per
    block (a power of two), `ctas` blocks, the product `factor`."""

    rows: int
    ctas: int
    factor: float


_INT32_MAX = 2**31 - 1
_LIMITS: dict = {}  # device index -> (SMs, threads per SM)


def _device_limits(device: torch.device):
    """(multiProcessorCount, maxThreadsPerMultiProcessor) of a CUDA device, cached; ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    limits = _LIMITS.get(index)
    if limits is None:
        props = torch.cuda.get_device_properties(index)
        limits = _LIMITS[index] = (props.multi_processor_count, props.max_threads_per_multi_processor)
    return limits


def fused_shape(batch: int, spatial: int, order: MeanOrder, vec: int, sms: int):
    """The fused kernel's launch shape, ``((tiles, batch, 1), (vectors, units' threads, 1))``, as the .cu's
    fused_shape computes it; ``None`` where one vector's scratch does not fit kSharedFloats (or the grid its limits)."""
    partials = order.rows * order.ctas
    units = 4 * partials if partials <= _CHAIN_PARTIALS else partials
    entries = units + (order.rows if order.ctas > 1 else 0) + 1
    ty = last_pow2(min(units, _UNIT_THREADS))
    tx = _FUSED_THREADS // ty
    while tx > 1 and entries * tx * vec > _SHARED_FLOATS:
        tx //= 2
    if entries * tx * vec > _SHARED_FLOATS:
        return None
    vecs = div_up(spatial, vec)
    while tx > 1 and batch * div_up(vecs, tx) < _MIN_BLOCKS_PER_SM * sms:
        tx //= 2
    tiles = div_up(vecs, tx)
    if tiles > _INT32_MAX or batch > 65535:
        return None
    return (tiles, batch, 1), (tx, ty, 1)


def order_of(config, batch: int, channels: int, spatial: int) -> MeanOrder:
    """The `MeanOrder` of aten's reduce kernel run with `config` (`aten_reduce_config`) over dim 1 of a ``[B, C, S]``
    tensor: its partial sums' rows (split across warps or not), its blocks per output, the mean's factor."""
    return MeanOrder(config.block_height if config.split_across_warps else 1, config.ctas_per_output,
                     mean_factor(batch, channels, spatial))


@functools.lru_cache(maxsize=1024)  # a VAE has a handful of shapes
def _order(batch: int, channels: int, spatial: int, dtype: torch.dtype, limits: tuple, storage=None):
    """aten's order of the mean over dim 1 of a contiguous ``[B, C, S]`` tensor of `dtype` (the mean's input), as a
    fused kernel reading x of `storage` (its 16-byte vectors; default `dtype`) takes it, or why none is reproduced.
    (LTX-Video's norm, `ltx_vae_rmsnorm_conv`, takes the order of its fp32 squares over bf16 / fp16 x.)"""
    storage = dtype if storage is None else storage
    if spatial < 2 or channels < 2:
        return "one position or one channel: another iterator"
    if (batch * channels * spatial - 1) * dtype.itemsize + 1 > _INT32_MAX:
        return "beyond 32-bit indexing: aten splits the reduction"
    if dtype == torch.float32 and channels % 1024 == 0:
        return "fp32 over a multiple of 1024 channels: aten's accumulators not pinned"
    order = order_of(aten_reduce_config(batch, channels, spatial, *limits), batch, channels, spatial)
    if fused_shape(batch, spatial, order, _VEC_BYTES // storage.itemsize, limits[0]) is None:
        return "beyond the fused kernel's launch: its scratch (aten's partial sums) or grid (batches)"
    return order


def mean_order(x: torch.Tensor) -> MeanOrder | str:
    """aten's order of ``torch.mean(x**2, dim=1)`` for x ``[B, C, *]`` (the guard's layouts) on x's device, as the
    fused kernel takes it, or why the op keeps aten's own square and mean for x (the module docstring)."""
    limits = _device_limits(x.device)
    if limits is None:
        return "not on a CUDA device"
    return _order(int(x.shape[0]), int(x.shape[1]), int(math.prod(x.shape[2:])), x.dtype, limits)


MEAN_FALLBACKS: Counter = Counter()  # calls that ran aten's square and mean, by `mean_order`'s reason


def _tree(values: list) -> torch.Tensor:
    """block_y_reduce over a power-of-two list: v[y] = v[y] + v[y + off] for off = len / 2 .. 1; v[0]."""
    off = len(values) // 2
    while off:
        for y in range(off):
            values[y] = values[y] + values[y + off]
        off //= 2
    return values[0]


def channel_mean_arithmetic(x: torch.Tensor, order: MeanOrder) -> torch.Tensor:
    """aten's ``torch.mean(x**2, dim=1)`` of x ``[B, C, S]`` in the order `order` (every fp32 add a separate torch op,
    so rounded as the kernel's ``__fadd_rn``), ``[B, S]`` of x's dtype: the fused kernel's statistics in torch, what
    the tests' emulated kernel runs on a CPU and the documentation of its order in code."""
    q = (x.float() * x.float()).to(x.dtype).float()
    channels, partials = x.shape[1], order.rows * order.ctas
    zero = torch.zeros_like(q[:, 0])

    def partial(j: int) -> torch.Tensor:
        acc = [zero] * 4
        for k, c in enumerate(range(j, channels, partials)):
            acc[k % 4] = acc[k % 4] + q[:, c]
        return ((acc[0] + acc[1]) + acc[2]) + acc[3]

    return combine_partials([partial(j) for j in range(partials)], order, x.dtype)


def combine_partials(partials: list, order: MeanOrder, dtype: torch.dtype) -> torch.Tensor:
    """A position's mean from its `order.rows` x `order.ctas` partial sums (float tensors, partial j of block g at
    j = g rows + y), as aten combines them (csrc/per_channel_rmsnorm.cuh's position_mean): each block's tree, with
    several blocks the global step (row y adds blocks y, y + rows, ... from 0) and its tree, the product with the
    factor, rounded to `dtype`."""
    blocks = [_tree([partials[g * order.rows + y] for y in range(order.rows)]) for g in range(order.ctas)]
    if order.ctas == 1:
        total = blocks[0]
    else:
        rows = []
        for y in range(order.rows):
            t = torch.zeros_like(blocks[0])
            for g in range(y, order.ctas, order.rows):
                t = t + blocks[g]
            rows.append(t)
        total = _tree(rows)
    return (total * torch.tensor(order.factor, dtype=torch.float32)).to(dtype)


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
    items = batch * div_up(channels, _CHANNELS) * (spatial // (_VEC_BYTES // x.element_size()) if vector else spatial)
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

# The fused kernel the NVRTC way, launched as the .cu's launch_fused and bindings_vae.cpp's per_channel_rmsnorm_fused
# do: its parameters (the args struct, then rows, ctas and factor), the output, vectors or elements, `fused_shape`.
_NVRTC_FUSED = _nvrtc.Kernel("per_channel_rmsnorm.cu", "diffusers_fastpath::per_channel_rmsnorm_fused_kernel",
                             {(dtype, vector): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(vector).lower()}"
                              for dtype in FLOAT_DTYPES for vector in (True, False)},
                             _nvrtc.Params("per_channel_rmsnorm_fused_kernel", ("a", _ARGS), ("rows", "i"),
                                           ("ctas", "i"), ("factor", "f")))


def _raw_fused_guard(x, eps, silu, rows, ctas, factor, probe):
    if x.dim() != 3 or x.dtype not in FLOAT_DTYPES or (x.shape[2] > 1 and x.stride(2) != 1):
        return "x"
    if probe not in (0, PROBE_MEAN) or (probe and silu):
        return "probe"
    if not (1 <= rows <= 512 and rows & (rows - 1) == 0 and 1 <= ctas <= 65536):
        return "order"
    if not x.is_cuda:
        return "device"
    return None


def _nvrtc_fused(x, eps, silu, rows, ctas, factor, probe):
    batch, channels, spatial = x.shape
    if probe == PROBE_MEAN:
        out = torch.empty(batch, spatial, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    vector = vectors(x, None, out)
    device = x.device.index
    shape = fused_shape(batch, spatial, MeanOrder(rows, ctas, factor),
                        _VEC_BYTES // x.element_size() if vector else 1, _nvrtc.num_sms(device))
    if shape is None:
        raise ValueError("per_channel_rmsnorm_fused: aten's partial sums do not fit the kernel's scratch")
    if x.numel() == 0:
        return out
    _NVRTC_FUSED.launch(device, (x.dtype, vector), *shape, out.data_ptr(), x.data_ptr(), 0, batch, channels, spatial,
                        x.stride(0), x.stride(1), eps, int(silu), int(probe), _nvrtc.DTYPE_CODE[x.dtype], rows, ctas,
                        factor)
    return out


_nvrtc.raw_op("_per_channel_rmsnorm_fused_cuda",
              "(Tensor x, float eps, bool silu, int rows, int ctas, float factor, int probe) -> Tensor",
              _raw_fused_guard, _nvrtc_fused)

# (x, eps, silu, rows, ctas, factor, probe)
_launch_fused = LazyLauncher(_nvrtc_fused, "_per_channel_rmsnorm_fused_cuda")


def _fused(x: torch.Tensor, eps, silu: bool) -> torch.Tensor:
    """The norm over x's memory as ``[B, C, S]`` (its strides: channels and batches possibly apart), the result
    contiguous, as eager's is (`channel_strides`): the fused kernel where `mean_order` gives aten's order, else eager's
    own square and mean (``[B, 1, *]``, read as ``[B, S]``) and the first kernel."""
    batch, channels = x.shape[:2]
    x3 = x.reshape(batch, channels, -1)
    eps = eps_as_added(eps, x.dtype, x.device)
    order = mean_order(x)
    if type(order) is MeanOrder:
        out = _launch_fused(x3, eps, silu, order.rows, order.ctas, order.factor, 0)
    else:
        MEAN_FALLBACKS[order] += 1
        mean = torch.mean(x**2, dim=1, keepdim=True)  # the module's own two calls: aten's kernels, aten's order
        out = _launch(x3, mean.reshape(batch, -1).contiguous(), eps, silu, 0)
    return out.view(x.shape)


def _kernel(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps, False)


def _kernel_silu(norm, x: torch.Tensor) -> torch.Tensor:
    return _fused(x, norm.eps, True)


def _signature(norm, x: torch.Tensor):
    """What one first-call ``torch.equal`` (and the proofs) vouch for: the dtype, whether the kernel runs vectors or
    elements as far as x's sizes and strides decide it (what torch.compile can read of a traced x; an x at an offset of
    no multiple of 16 bytes runs elements under the vectors' key: the proofs cover both ways, and the division is exact
    by construction either way), the eps (the proofs' r depends on it), and the mean's order (`mean_order`): the
    channels, rows and ctas of the fused kernel's statistics (one check per order; the factor is aten's host
    arithmetic, exact by construction), or aten's own mean."""
    vec = _VEC_BYTES // x.element_size()
    batch_stride, channel_stride = channel_strides(x)
    vector = math.prod(x.shape[2:]) % vec == 0 and channel_stride % vec == 0 and batch_stride % vec == 0
    order = mean_order(x)
    mean = (f"mean of {x.shape[1]} in {order.rows} x {order.ctas}" if type(order) is MeanOrder else "aten's mean")
    return str(x.dtype).removeprefix("torch."), "vectors" if vector else "elements", float(norm.eps), mean


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
    """``norm(x)`` for LTX-2's VAE norm in one kernel on CUDA (the square and aten's channel mean in aten's order,
    then the rest; aten's square and mean, then the rest, where `mean_order` keeps them), bit-identical to eager
    everywhere (the statistics aten's float operations in aten's order, the division exact by construction,
    ``sqrt(m + eps)`` proven on every value of the dtype, the first call of each signature compared with eager).

    Example:
        >>> from diffusers.models.autoencoders.autoencoder_kl_ltx2 import PerChannelRMSNorm
        >>> norm, x = PerChannelRMSNorm(), torch.randn(1, 128, 4, 16, 16)
        >>> torch.equal(per_channel_rmsnorm(norm, x), norm(x))  # (on a CPU: the module's forward runs)
        True

    Args:
        norm: the norm module (diffusers' ``PerChannelRMSNorm``, registered by `add_norm_class`), whose forward this
            is (its hooks have run: the module's own call).
        x: ``[B, C, *]`` activations (the resnets' ``[B, C, T, H, W]``).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return PER_CHANNEL_RMSNORM(site, norm, x)


def per_channel_rmsnorm_silu(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``F.silu(norm(x))`` (the norm and the ``nn.SiLU`` module after it) in the norm's kernel (`per_channel_rmsnorm`),
    bit-identical to eager everywhere (the SiLU proven on every value of the dtype on first use). It stands for the
    norm's call: a norm with hooks refuses it and ``F.silu(norm(x))`` runs; the SiLU module's hooks are the caller's
    to check (as `diffusers_fastpath.models.vae.PairCalls` does).

    Args:
        norm: the norm module of the site.
        x: ``[B, C, *]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return PER_CHANNEL_RMSNORM_SILU(site, norm, x)
