"""The channel RMS norm of Wan's and Qwen-Image's VAEs (diffusers' ``WanRMS_norm``, ``QwenImageRMS_norm``, channel
first), optionally followed by the residual block's SiLU, with everything after aten's norm reduction in one pass,
bit-identical to eager.

The module computes, for bf16/fp16/fp32 x of ``[B, C, *]`` (T its dtype, fp32 arithmetic, ``round`` to nearest even
in T where eager writes a tensor: nothing to round for fp32, where ``x.float()`` is x itself)::

    xf = x.float()
    d  = xf.norm(2.0, 1, keepdim=True).clamp_min(1e-12)   # F.normalize: aten's reduction, kept as eager runs it
    n  = round(xf / d)                                    # F.normalize's division, then .to(x.dtype)
    m  = round(n * scale)                                 # ``* self.scale``: a python float, cast to float by aten
    g  = round(m * gamma[c])                              # ``* self.gamma``: [C, 1, ...] of dtype T
    y  = round(g + bias)                                  # ``+ self.bias``: 0.0 (a python float) or [C, 1, ...]
    out = round(y / (1 + exp(-y)))                        # the SiLU module after it (the pair), aten's silu_kernel

Eager runs that tail as six kernels over the whole tensor (division, cast, three binary ops, SiLU: 2 + 4 bytes in,
out per element each); ``csrc/channel_rmsnorm_silu.cu`` reads x once and writes once. The norm reduction stays
aten's own (the same reduction kernel and launch, reading x itself where that is the same order of the same fp32
operations as reading its fp32 upcast: `reads_half_directly`, which saves the upcast's copy), and every operation
of the tail is a separate IEEE operation rounded where eager rounds (exact by construction; still, the first call
of each signature is compared with eager, `_signature`, as the self-verified ops are). The SiLU is aten's
expression with CUDA's ``expf``, proven on all 65536 values of the dtype on first use (the kernel's probe mode)
as `silu_mul` proves its own, and for an fp32 x (an fp32 VAE, as Wan's model card loads it) on all 2^32 fp32 bit
patterns, in chunks (`_prove_silu_fp32`: about 200 GB of memory traffic, a tenth of a second once per process;
the proofs are `_unary_proof`'s, shared with LTX-2's norm);
a mismatch disables the op for the process (one warning) and eager runs.

Written into the next convolution's input: where the pair's value goes to a Wan / Qwen-Image causal convolution (the
residual blocks' ``conv1`` and ``conv2``, the encoder's and decoder's ``conv_out``: `conv`, found in the block's
forward by `diffusers_fastpath.models.vae_wan`) whose channels-last path would take it
(`causal_conv_cl.takes_interior`), the kernel writes it straight into that convolution's padded channels-last input
(``csrc/causal_pad.cu``'s ``channel_rmsnorm_pad_cl_kernel``: the same device function of the same operands per
value, placed where ``causal_pad`` would copy it, the border zeros; the frames before x's it leaves to the
convolution) and the op returns the view of x's positions in it (`causal_conv_pad.interior_view`): the pair's
values, laid out as the convolution reads them. The convolution then writes only its cache's frames (and zeros
before them) into the buffer, where before the pair wrote its result and ``causal_pad`` read it back and wrote the
buffer (Wan 2.1's decode: about a third of those bytes). The view is not contiguous; the block reads it only as the
convolution's input and through ``x[:, :, -CACHE_T:].clone()`` (the reader proves that from the forward), and what
does not take it runs on ``x.contiguous()`` (`causal_conv_pad.as_eager`), eager's tensor. Such a call is its own
signature (`_signature`), checked on its first call as every other.

What the guard admits: a module of a class the VAE adapter registered (`add_norm_class`: diffusers' class after its
``forward`` was checked by source digest, or this package's subclass of it) with ``channel_first``, a python-number
``scale``, ``gamma`` of x's dtype shaped ``[C, 1, ...]`` to broadcast over x's trailing dims, ``bias`` a python number
or a tensor like ``gamma``; a bf16/fp16/fp32 x ``[B, C, *]``, contiguous, time-major (``[B, C, T, H, W]`` laid out as
``[B, T, C, H, W]``, as Wan's upsamplers leave it) or channels-last (HunyuanVideo-1.5's mid-block, one element per
thread), any trailing size (rows of a multiple of 8 elements run 16-byte vectors, others one element per thread:
Qwen-Image's 166x166 latents; each way its own first-call check); no
autograd; torch's ``F.normalize`` the form read here (source digest).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._source import body_digest
from . import _nvrtc
from . import causal_conv_cl as _conv_cl
from . import causal_conv_pad as _pad
from ._build import LazyLauncher
from ._policy import FLOAT_DTYPES, HALF_DTYPES, EagerClasses, FusedOp, Site
from ._unary_proof import FP32_CHUNK, prove_every_value, prove_fp32

_VEC_BYTES = 16
_EPS = 1e-12  # F.normalize's default, which the modules' forward uses (checked with it by digest)
_THREADS, _BLOCKS_PER_SM = 256, 8  # csrc/channel_rmsnorm_silu.cu's kThreads, kBlocksPerSm


# torch's F.normalize as read for this op (torch 2.13's body: ``denom = input.norm(p, dim, keepdim=True)
# .clamp_min(eps).expand_as(input); return input / denom``); another form leaves the op refusing, counted.
NORMALIZE_DIGESTS = frozenset({"de836cb24b5c2ec1"})
_NORMALIZE_OK = body_digest(F.normalize) in NORMALIZE_DIGESTS

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one


def add_norm_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' class (`base` None) once its ``forward`` was checked to be the
    norm documented above, or this package's subclass of `base` that adds no state and whose forward runs this op."""
    _BASES.add(cls, base)


def channel_rmsnorm_ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager norm: the diffusers class's ``forward`` (so that a subclass whose forward runs this op falls back to
    diffusers' code, not to itself)."""
    return _BASES.eager(norm).forward(norm, x)


def channel_rmsnorm_silu_ref(norm: nn.Module, x: torch.Tensor, conv: nn.Module | None = None) -> torch.Tensor:
    """The eager pair: the norm, then ``F.silu`` (an ``nn.SiLU`` module's forward); `conv` (where the fast path may
    write the result) changes nothing here."""
    return F.silu(channel_rmsnorm_ref(norm, x))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _guard(norm, x: torch.Tensor, conv: nn.Module | None = None, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(norm, "channel RMS norm")
    if reason is not None:
        return reason
    if not _NORMALIZE_OK:
        return "F.normalize is not the form the kernel continues"
    if not isinstance(x, torch.Tensor):
        return "input not a tensor"
    if getattr(norm, "channel_first", None) is not True:
        return "not channel first"
    dtype = x.dtype
    if dtype not in FLOAT_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if x.dim() < 3:
        return "x not [B, C, *]"
    gamma, bias, scale = getattr(norm, "gamma", None), getattr(norm, "bias", None), getattr(norm, "scale", None)
    if not _is_number(scale):
        return "scale not a python number"
    channels = x.shape[1]
    if not isinstance(gamma, torch.Tensor) or gamma.dtype is not dtype:
        return "gamma not of x's dtype"
    if tuple(gamma.shape) != (channels,) + (1,) * (x.dim() - 2):
        return "gamma does not broadcast over x's channels"
    if isinstance(bias, torch.Tensor):
        if bias.dtype is not dtype or bias.shape != gamma.shape:
            return "bias not like gamma"
    elif not _is_number(bias):
        return "bias not a python number or tensor"
    if not (x.is_contiguous() or _time_major(x) or _channels_last(x)):
        return "x not contiguous"
    if x.numel() == 0:
        return "empty"
    if torch.is_grad_enabled() and (x.requires_grad or gamma.requires_grad
                                    or (isinstance(bias, torch.Tensor) and bias.requires_grad)):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if gamma.device != x.device or (isinstance(bias, torch.Tensor) and bias.device != x.device):
        return "devices differ"
    if check_pointers and x.data_ptr() % _VEC_BYTES:
        return "not 16-byte aligned"
    return None


def _time_major(x: torch.Tensor) -> bool:
    """Whether x is ``[B, C, T, H, W]`` laid out as ``[B, T, C, H, W]`` (the upsampler's ``view(b, t, c, h, w)
    .permute(0, 2, 1, 3, 4)``): eager's result keeps that layout, and so does the kernel's (as ``B * T`` rows)."""
    return x.dim() == 5 and x.transpose(1, 2).is_contiguous()


def _channels_last(x: torch.Tensor) -> bool:
    """Whether x is ``[B, C, *]`` laid out channels last (HunyuanVideo-1.5's mid-block attention returns its output
    so, ``permute(0, 4, 1, 2, 3)``, and the convolutions after it keep that layout) with exactly the strides of such a
    permute of a contiguous tensor, size-1 dimensions included: eager's result keeps x's strides then, and so does the
    kernel's (each position a row of C channels: ``[B * T * H * W, C, 1]``). A size-1 dimension of another stride is
    refused: aten's TensorIterator places it by x's strides (eager's result then has strides of its own, which no
    cheap rule here reproduces; a meta run does not either, torch's Python meta kernels order size-1 dimensions
    otherwise)."""
    if x.dim() < 3:
        return False
    last = x.movedim(1, -1)
    expected, step = [0] * last.dim(), 1
    for d in reversed(range(last.dim())):
        expected[d] = step
        step *= last.shape[d]
    return last.stride() == tuple(expected)


def _layout(x: torch.Tensor) -> str:
    """The memory the kernel reads x as (see `_fused`); the guard admits no other. Channels-last comes before
    time-major: an x of H = W = 1 laid out channels last reads as time-major too, and its result has x's strides."""
    if x.is_contiguous():
        return "contiguous"
    return "channels-last" if _channels_last(x) else "time-major"


_INT32_MAX = 2**31 - 1


def reads_half_directly(x: torch.Tensor) -> bool:
    """Whether aten's norm reduction can read x itself instead of its fp32 upcast and give the same bits.

    ``torch.linalg.vector_norm(x, 2, 1, dtype=torch.float32)`` of a bf16/fp16 CUDA x is aten's "type promotion that
    does cast and reduction in a single kernel": ``norm_kernel_cuda_impl<T, float, float>``, the same
    ``gpu_reduce_kernel`` template as the upcast's ``norm_kernel_cuda_impl<float>`` with the same ``NormTwoOps``
    (``acc + float(v) * float(v)``, ``combine`` a sum, ``sqrt``). ``setReduceConfig`` sees the same shape and element
    strides, so it picks the same block, the same split of the channels across threads and the same output vector, so
    every output is summed in the same order: provided the two things that read bytes agree, which is what is checked
    here. ``get_output_vec_size`` divides x's address by its element size (the upcast is a fresh allocation, 4-element
    aligned): x's address must be a multiple of 4 elements; and a reduction whose fp32 operand passes 2 GiB is split
    into 32-bit-indexable pieces that accumulate through a buffer (the upcast would be, x might not be): below that,
    neither is. The first call of each signature is still compared with eager (`_signature`)."""
    return (x.is_cuda and x.dtype in HALF_DTYPES and x.data_ptr() % (4 * x.element_size()) == 0
            and x.numel() * 4 <= _INT32_MAX)


def denominator(x: torch.Tensor) -> torch.Tensor:
    """What eager divides by: ``F.normalize``'s ``input.norm(2.0, 1, keepdim=True).clamp_min(eps)`` on the fp32 upcast,
    computed without the upcast where aten's reduction reading x gives the same bits (`reads_half_directly`: one read
    of x instead of a copy to fp32 and a read of that, 10 bytes an element down to 2)."""
    if reads_half_directly(x):
        norm = torch.linalg.vector_norm(x, 2.0, 1, keepdim=True, dtype=torch.float32)
    else:
        norm = x.float().norm(2.0, 1, keepdim=True)
    return norm.clamp_min(_EPS)


def channel_rmsnorm_arithmetic(x: torch.Tensor, denom: torch.Tensor, gamma: torch.Tensor, bias, scale: float,
                               silu: bool) -> torch.Tensor:
    """The kernel's arithmetic in torch (each step rounded to x's dtype where the kernel rounds): what the tests'
    emulated kernels run on a CPU, and the documentation of ``csrc/channel_rmsnorm_silu.cu`` in code."""
    dtype = x.dtype
    n = (x.float() / denom).to(dtype)
    m = (n.float() * torch.tensor(scale, dtype=torch.float32)).to(dtype)
    g = (m.float() * gamma.float()).to(dtype)
    b = bias.float() if isinstance(bias, torch.Tensor) else torch.tensor(bias, dtype=torch.float32)
    y = (g.float() + b).to(dtype)
    return F.silu(y) if silu else y


# The NVRTC way (ops/_nvrtc.py): csrc/channel_rmsnorm_silu.cu's kernel, launched as its launch() and bindings.cpp's
# channel_rmsnorm do. Duplicated from there: the ChannelRmsNormArgs fields (fastpath.h), the output allocation and
# the grid (one thread per vector, at most kBlocksPerSm blocks per SM); the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("ChannelRmsNormArgs", ("out", "P"), ("x", "P"), ("denom", "P"), ("gamma", "P"), ("bias", "P"),
                      ("batch", "q"), ("channels", "q"), ("spatial", "q"), ("scale", "f"), ("bias_value", "f"),
                      ("silu", "i"), ("probe", "i"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel("channel_rmsnorm_silu.cu", "diffusers_fastpath::channel_rmsnorm_kernel",
                       {(dtype, vector): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(vector).lower()}"
                        for dtype in FLOAT_DTYPES for vector in (True, False)},
                       _nvrtc.Params("channel_rmsnorm_kernel", ("a", _ARGS)))


def _raw_guard(x, denom, gamma, bias, scale, bias_value, silu, probe):
    batch, channels = (x.shape[0], x.shape[1]) if x.dim() >= 3 else (0, 0)
    spatial = x.numel() // max(1, batch * channels)
    if x.dim() < 3 or x.dtype not in FLOAT_DTYPES or not x.is_contiguous():
        return "x"
    if denom.dtype != torch.float32 or not denom.is_contiguous() or denom.numel() != batch * spatial:
        return "denom"
    for t in (gamma, bias):
        if t is not None and (t.dtype != x.dtype or t.shape != (channels,) or not t.is_contiguous()):
            return "gamma or bias"
    if not x.is_cuda or any(t is not None and t.device != x.device for t in (denom, gamma, bias)):
        return "device"
    if x.data_ptr() % _VEC_BYTES or denom.data_ptr() % _VEC_BYTES:
        return "not 16-byte aligned"
    return None


def _vectors(spatial: int, dtype: torch.dtype) -> bool:
    """Whether the kernel runs 16-byte vectors over rows of `spatial` elements of `dtype` (a multiple of the vector),
    as csrc/channel_rmsnorm_silu.cu's launch() decides; else one element per thread."""
    return spatial % (_VEC_BYTES // dtype.itemsize) == 0


def _nvrtc_kernel(x, denom, gamma, bias, scale, bias_value, silu, probe):
    batch, channels = x.shape[:2]
    spatial = x.numel() // max(1, batch * channels)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    vector = _vectors(spatial, x.dtype)
    vecs = x.numel() * x.element_size() // _VEC_BYTES if vector else x.numel()
    if vecs == 0:
        return out
    device = x.device.index
    blocks = _nvrtc.grid_stride_blocks(device, vecs, _THREADS, _BLOCKS_PER_SM)
    _NVRTC.launch(device, (x.dtype, vector), (blocks, 1, 1), (_THREADS, 1, 1), out.data_ptr(), x.data_ptr(),
                  denom.data_ptr(), gamma.data_ptr(), 0 if bias is None else bias.data_ptr(), batch, channels, spatial,
                  scale, bias_value, int(silu), int(probe), _nvrtc.DTYPE_CODE[x.dtype])
    return out


_nvrtc.raw_op("_channel_rmsnorm_cuda", "(Tensor x, Tensor denom, Tensor gamma, Tensor? bias, float scale, "
              "float bias_value, bool silu, bool probe) -> Tensor", _raw_guard, _nvrtc_kernel)

_raw = LazyLauncher(_nvrtc_kernel, "_channel_rmsnorm_cuda")  # (x, denom, gamma, bias, scale, bias_value, silu, probe)

# The padded result the NVRTC way: csrc/causal_pad.cu's channel_rmsnorm_pad_cl kernels, launched as its
# launch_channel_norm and bindings_vae.cpp's channel_rmsnorm_pad_cl do: causal_pad's arguments and output
# (`causal_conv_pad.launch_fields`: channels-last, no cache, the zero border; the wide kernel where its vectors are
# whole), then the denominator, gamma, bias and the two floats.
_NVRTC_PAD, _NVRTC_PAD_WIDE = (
    _nvrtc.Kernel("causal_pad.cu", f"diffusers_fastpath::{name}",
                  {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
                  _nvrtc.Params(name, ("a", _pad._ARGS), ("denom", "P"), ("gamma", "P"), ("bias", "P"),
                                ("scale", "f"), ("bias_value", "f")))
    for name in ("channel_rmsnorm_pad_cl_kernel", "channel_rmsnorm_pad_cl_wide_kernel"))


def _raw_pad_guard(x, denom, gamma, bias, scale, bias_value, padding):
    reason = _pad._raw_guard(x, None, padding, True)
    if reason is not None:
        return reason
    if x.dtype not in HALF_DTYPES:
        return "dtype"
    if not (denom.dtype == torch.float32 and denom.is_contiguous() and denom.device == x.device
            and denom.numel() == x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4]):
        return "denom"
    for t in (gamma, bias):
        if t is not None and (t.dtype != x.dtype or t.shape != (x.shape[1],) or not t.is_contiguous()
                              or t.device != x.device):
            return "gamma or bias"
    return None


def _nvrtc_pad(x, denom, gamma, bias, scale, bias_value, padding):
    out, fields, wide, grid, block = _pad.launch_fields(x, None, padding, True, False, False, denom)
    if out.numel():
        (_NVRTC_PAD_WIDE if wide else _NVRTC_PAD).launch(
            x.device.index, x.dtype, grid, block, *fields, denom.data_ptr(), gamma.data_ptr(),
            0 if bias is None else bias.data_ptr(), scale, bias_value)
    return out


_nvrtc.raw_op("_channel_rmsnorm_pad_cl_cuda", "(Tensor x, Tensor denom, Tensor gamma, Tensor? bias, float scale, "
              "float bias_value, int[] padding) -> Tensor", _raw_pad_guard, _nvrtc_pad)

_raw_pad = LazyLauncher(_nvrtc_pad, "_channel_rmsnorm_pad_cl_cuda")  # (x, denom, gamma, bias, scale, bias_value, padding)


def pad_arithmetic(x: torch.Tensor, denom: torch.Tensor, gamma: torch.Tensor, bias, scale: float, bias_value: float,
                   padding) -> torch.Tensor:
    """What the padded kernel writes, in torch, for x ``[B, C, T, H, W]`` and its fp32 ``[B, T * H * W]`` denominator
    (the tests' emulation, and the kernel's documentation in code): the pair's arithmetic
    (`channel_rmsnorm_arithmetic` with the SiLU), then ``causal_pad``'s channels-last buffer of it without a cache
    (`causal_conv_pad.pad_arithmetic`: zeros on the border), but for the first frames inside the border, which the
    kernel leaves to the convolution (`causal_conv_pad.fill_front` writes its cache and zeros there): NaN here, what
    no reader may see."""
    shape = (-1,) + (1,) * (x.dim() - 2)
    y = channel_rmsnorm_arithmetic(x, denom.reshape(x.shape[0], 1, *x.shape[2:]), gamma.reshape(shape),
                                   bias_value if bias is None else bias.reshape(shape), scale, True)
    buf = _pad.pad_arithmetic(y, None, list(padding), True)
    pw0, pw1, ph0, ph1, pt0, _ = padding
    buf[:, :, :pt0, ph0:buf.shape[3] - ph1, pw0:buf.shape[4] - pw1] = float("nan")
    return buf


def _pad_target(conv: nn.Module | None, x: torch.Tensor) -> list[int] | None:
    """The padding of the buffer the pair writes its result into for `conv` (the module doc), or ``None``: no `conv`,
    x not a bf16 / fp16 ``[B, C, T, H, W]`` contiguous or time-major (the pad kernel reads any strides with a unit
    one along W), or a convolution whose channels-last path would not take the buffer now
    (`causal_conv_cl.takes_interior`)."""
    if conv is None or x.dim() != 5 or x.dtype not in HALF_DTYPES or not (x.is_contiguous() or _time_major(x)):
        return None
    return list(conv._padding) if _conv_cl.takes_interior(conv, x) else None


def _tensors(norm):
    """gamma and bias as the kernel takes them: ``[C]`` views, and the bias as a tensor or a float."""
    bias = norm.bias
    if isinstance(bias, torch.Tensor):
        return norm.gamma.reshape(-1), bias.reshape(-1), 0.0
    return norm.gamma.reshape(-1), None, float(bias)


def _fused(x: torch.Tensor, gamma: torch.Tensor, bias, scale: float, bias_value: float, silu: bool,
           padding: list[int] | None = None) -> torch.Tensor:
    """The kernel over x's memory as ``[rows, C, spatial]``: x contiguous, time-major (`_time_major`: ``B * T`` rows
    of ``[C, H * W]``) or channels-last (`_channels_last`: a row of ``[C, 1]`` per position), the result in x's
    layout as eager's is. The denominator is aten's, on x as eager takes it, laid out in the same row order
    (``[B, 1, T, H, W]``: one value per row and position). With `padding` (`_pad_target`'s), the padded kernel: the
    view of x's positions in the convolution's buffer."""
    denom = denominator(x).contiguous()
    if padding is not None:
        buf = _raw_pad(x, denom.view(x.shape[0], -1), gamma, bias, scale, bias_value, padding)
        return _pad.interior_view(buf, padding)
    layout = _layout(x)
    if layout == "contiguous":
        out = _raw(x, denom, gamma, bias, scale, bias_value, silu, False)
    elif layout == "time-major":
        batch, channels, frames, height, width = x.shape
        rows = x.transpose(1, 2).reshape(batch * frames, channels, height * width)  # a view (time-major memory)
        out = _raw(rows, denom, gamma, bias, scale, bias_value, silu, False)
        out = out.view(batch, frames, channels, height, width).transpose(1, 2)
    else:  # channels-last (`_channels_last`: x's strides exactly those of the view below, as eager's result's)
        rows = x.movedim(1, -1).reshape(-1, x.shape[1], 1)  # a view (channels-last memory)
        out = _raw(rows, denom, gamma, bias, scale, bias_value, silu, False)
        return out.view(x.movedim(1, -1).shape).movedim(-1, 1)
    # Eager's strides to the last size-1 dimension (a later op that reads strides, e.g. a memory-format choice, sees
    # what eager made): the norm's arithmetic keeps x's, also where x counts as contiguous with a size-1 dimension of
    # another stride (a time-major x of one frame); F.silu of a contiguous tensor gives the plain contiguous strides
    if silu or out.stride() == x.stride():
        return out
    return out.as_strided(x.shape, x.stride())


def _kernel(norm, x: torch.Tensor, silu: bool = False, conv: nn.Module | None = None) -> torch.Tensor:
    gamma, bias, bias_value = _tensors(norm)
    return _fused(x, gamma, bias, float(norm.scale), bias_value, silu, _pad_target(conv, x))


def _kernel_silu(norm, x: torch.Tensor, conv: nn.Module | None = None) -> torch.Tensor:
    return _kernel(norm, x, True, conv)


def _signature(norm, x: torch.Tensor, conv: nn.Module | None = None):
    """What one first-call ``torch.equal`` vouches for: the dtype, the layout the kernel reads (contiguous,
    time-major or channels-last) and the bias's kind. The tail is exact by construction; the check is its second
    line (the kernel is new on each GPU kind it meets), the proof covers the SiLU; whether it runs vectors or
    elements, whether the norm reduction reads x or its fp32 upcast (`reads_half_directly`), and the padding of the
    buffer it writes its result into (`_pad_target`; ``()``: its own tensor) with whether that kernel runs 16-byte
    vectors (`causal_conv_pad.wide_fits`: 8 channels and columns)."""
    bias = getattr(norm, "bias", None)
    layout = _layout(x)
    spatial = {"contiguous": math.prod(x.shape[2:]), "time-major": math.prod(x.shape[3:]), "channels-last": 1}[layout]
    padding = _pad_target(conv, x)
    padded = () if padding is None else (tuple(padding), x.shape[1] % 8 == 0 and x.shape[4] % 8 == 0)
    return (str(x.dtype).removeprefix("torch."), layout, isinstance(bias, torch.Tensor),
            _vectors(spatial, x.dtype), reads_half_directly(x), padded)


_FP32_PROVEN: set[torch.device] = set()  # the devices where `_prove_silu_fp32` passed


def _silu_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel's SiLU alone (its probe mode: y = x, then the SiLU) on a ``[1, 1, n]`` row (`_unary_proof`)."""
    denom = torch.empty(row.shape, dtype=torch.float32, device=row.device)  # (probe: not read)
    return _raw(row, denom, row.new_ones(1), None, 1.0, 0.0, True, True)


def _prove_silu_fp32(device: torch.device, start: int = -(1 << 31), stop: int = 1 << 31,
                     chunk: int = FP32_CHUNK) -> bool:
    """The kernel's SiLU equals eager's ``F.silu`` on all 2^32 fp32 bit patterns, both ways the kernel runs
    (`_unary_proof.prove_fp32`; `start`, `stop` and `chunk` the tests' way to run a part of it)."""
    return prove_fp32(device, _silu_probe, F.silu, start, stop, chunk)


def _prove_silu(norm, x: torch.Tensor, conv: nn.Module | None = None) -> bool:
    """The kernel's SiLU equals eager's on every value of the dtype, both ways it runs (`_unary_proof`: the 65536
    bf16 / fp16 values as one row; fp32's 2^32 values by `_prove_silu_fp32`, once per device)."""
    return prove_every_value(x, _silu_probe, F.silu, _FP32_PROVEN, x.device, _prove_silu_fp32)


@torch.library.custom_op("diffusers_fastpath::channel_rmsnorm", mutates_args=())
def _channel_rmsnorm_op(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, scale: float,
                        bias_value: float, silu: bool) -> torch.Tensor:
    # What torch.compile runs: the kernel (the caller's guard admitted these inputs; torch.compile emits this op only
    # for dtypes already proven, see FusedOp); the arithmetic's eager form elsewhere.
    if x.is_cuda:
        return _fused(x, gamma, bias, scale, bias_value, silu)
    return channel_rmsnorm_arithmetic(x, denominator(x), gamma.view(-1, *([1] * (x.dim() - 2))),
                                      bias_value if bias is None else bias.view(-1, *([1] * (x.dim() - 2))),
                                      scale, silu)


@_channel_rmsnorm_op.register_fake
def _(x, gamma, bias, scale, bias_value, silu):
    torch._check(x.dim() >= 3, lambda: f"channel_rmsnorm: x must be [B, C, *], got {tuple(x.shape)}")
    if silu and x.is_contiguous():  # as `_fused` returns it: eager's strides
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty_like(x)  # x's layout (time-major or channels-last: what the guard admits), as eager's


def _custom(silu: bool):
    def call(norm, x, conv=None):  # (under torch.compile: its own tensor, never a padded buffer)
        gamma, bias, bias_value = _tensors(norm)
        return torch.ops.diffusers_fastpath.channel_rmsnorm.default(x, gamma, bias, float(norm.scale), bias_value, silu)
    return call


CHANNEL_RMSNORM = FusedOp("channel_rmsnorm", ref=channel_rmsnorm_ref, guard=_guard, kernel=_kernel,
                          custom_op=_custom(False), verify_key=_signature)
CHANNEL_RMSNORM_SILU = FusedOp("channel_rmsnorm_silu", ref=channel_rmsnorm_silu_ref, guard=_guard,
                               kernel=_kernel_silu, custom_op=_custom(True), verify_key=_signature, prove=_prove_silu)


def channel_rmsnorm(norm: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``norm(x)`` for Wan's / Qwen-Image's channel RMS norm: aten's norm reduction, then the rest in one pass on
    CUDA, bit-identical to eager everywhere (exact by construction).

    Args:
        norm: the norm module (``WanRMS_norm`` or ``QwenImageRMS_norm``, registered by the VAE adapter).
        x: ``[B, C, *]`` activations (the resnets' ``[B, C, T, H, W]``, the attention's ``[B*T, C, H, W]``).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return CHANNEL_RMSNORM(site, norm, x)


def channel_rmsnorm_silu(norm: nn.Module, x: torch.Tensor, site: Site | None = None,
                         conv: nn.Module | None = None) -> torch.Tensor:
    """``F.silu(norm(x))`` (the norm and the ``nn.SiLU`` module after it) in one pass after aten's norm reduction,
    bit-identical to eager everywhere (the SiLU proven on every value of the dtype on first use).

    Args:
        norm: the norm module of the site.
        x: ``[B, C, *]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        conv: the causal convolution the result goes to, where the caller proved that nothing else reads it but
            through a slice's ``clone()`` (see the module doc): the result is then written into that convolution's
            padded channels-last input where its channels-last path takes it, and is the view of x's positions there.
    """
    return CHANNEL_RMSNORM_SILU(site, norm, x, conv)
