"""The 2x nearest upsampling of Wan's and Qwen-Image's VAE decoders (diffusers' ``WanUpsample``,
``QwenImageUpsample``) in one pass over its input and output.

The module's forward (checked by source digest by the VAE adapter) is ``nn.Upsample.forward(self, x.float())
.type_as(x)`` with ``scale_factor=(2.0, 2.0)`` and ``mode="nearest-exact"``: an upcast (bf16 -> fp32, a full write
at fp32), the interpolation in fp32 (a read at fp32, a write at four times that), the cast back (a read at fp32 and
a write at bf16, four times the input each): fifty bytes moved per input element of bf16 where the result itself is
eight. The kernel (``csrc/upsample_nearest.cu``) reads each element once and writes its 2x2 block: every value comes
out as eager's round trip leaves it (the same conversions; a NaN's payload and sign canonicalised alike), at the
source index eager's nearest modes read for an exact factor of 2. Exact by construction, no self-verification.

What the guard admits: a module of a class the adapter registered (`add_upsample_class`) configured as above (either
nearest mode, a factor of exactly 2 on both axes, no size), x a bf16/fp16/fp32 ``[N, C, H, W]`` (fp32: an fp32 VAE's,
whose ``x.float()`` is x and whose interpolation is a copy, as the kernel's) on CUDA with a unit W
stride and W > 1 (contiguous, or the time-major view Wan's resampling makes: eager's result is contiguous for any
such x, and so is the kernel's), no autograd. Anything else runs the module's forward as diffusers wrote it.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FLOAT_DTYPES, EagerClasses, FusedOp, Site

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one


def add_upsample_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' class (`base` None) once its ``forward`` was checked to be the
    one documented above and its parent's ``forward`` is ``nn.Upsample.forward``, or this package's subclass of
    `base` that adds no state and whose forward runs this op."""
    _BASES.add(cls, base)


def upsample_nearest2x_ref(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager forward: the diffusers class's (so that this package's subclass falls back to diffusers' code)."""
    return _BASES.eager(module).forward(module, x)


def _factor_two(scale) -> bool:
    return isinstance(scale, (tuple, list)) and len(scale) == 2 and all(
        type(s) is float and s == 2.0 for s in scale) or (type(scale) is float and scale == 2.0)


def _guard(module: nn.Module, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(module, "upsampling")
    if reason is not None:
        return reason
    if (getattr(module, "mode", None) not in ("nearest", "nearest-exact") or getattr(module, "size", 0) is not None
            or not _factor_two(getattr(module, "scale_factor", None)) or getattr(module, "align_corners", 0) is not None):
        return "not a 2x nearest upsampling"
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return "x not [N, C, H, W]"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.numel() == 0:
        return "empty"
    if x.stride(3) != 1 or x.shape[3] < 2 or any(st < 0 for st in x.stride()):
        return "layout"  # (a unit W stride, W > 1: eager's result is contiguous, never channels-last)
    if torch.is_grad_enabled() and x.requires_grad:
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    return None


# The NVRTC way: csrc/upsample_nearest.cu's kernel, launched as its launch() and bindings.cpp's upsample_nearest2x do.
# Duplicated from there: kThreads 256, kMaxRowBlocks 65535 (tests/test_nvrtc.py reads them from the .cu), the
# UpsampleNearestArgs fields (fastpath.h) and the output allocation; the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("UpsampleNearestArgs", ("out", "P"), ("x", "P"), ("batch", "q"), ("channels", "q"),
                      ("height", "q"), ("width", "q"), ("stride_n", "q"), ("stride_c", "q"), ("stride_h", "q"),
                      ("dtype", "i"))
_NVRTC = _nvrtc.Kernel(
    "upsample_nearest.cu",
    "diffusers_fastpath::upsample_nearest2x_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in FLOAT_DTYPES},
    _nvrtc.Params("upsample_nearest2x_kernel", ("a", _ARGS)),
)
_THREADS = 256
_MAX_ROW_BLOCKS = 65535


def _nvrtc_kernel(x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    out = x.new_empty(n, c, 2 * h, 2 * w)
    if out.numel():
        grid = ((w + _THREADS - 1) // _THREADS, min(n * c * h, _MAX_ROW_BLOCKS), 1)
        _NVRTC.launch(x.device.index, x.dtype, grid, (_THREADS, 1, 1), out.data_ptr(), x.data_ptr(), n, c, h, w,
                      *x.stride()[:3], _nvrtc.DTYPE_CODE[x.dtype])
    return out


def _raw_guard(x):
    # bindings.cpp's checks: a CUDA [N, C, H, W] of a half dtype with unit W stride
    if x.dim() != 4 or x.dtype not in FLOAT_DTYPES or (x.shape[3] > 1 and x.stride(3) != 1) or not x.is_cuda:
        return "shape, dtype or layout"
    return None


_nvrtc.raw_op("_upsample_nearest2x_cuda", "(Tensor x) -> Tensor", _raw_guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_upsample_nearest2x_cuda")


def _kernel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _cuda_op(x)


UPSAMPLE_NEAREST2X = FusedOp("upsample_nearest2x", ref=upsample_nearest2x_ref, guard=_guard, kernel=_kernel,
                             custom_op=upsample_nearest2x_ref)  # (the module's own forward: its hooks ran around it)


def upsample_nearest2x(module: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``module(x)`` for Wan's / Qwen-Image's 2x upsampling (``nn.Upsample`` of ``x.float()``, cast back), fused on
    CUDA and bit-identical to eager.

    Args:
        module: the module (``WanUpsample`` or ``QwenImageUpsample``, registered by the VAE adapter).
        x: ``[N, C, H, W]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return UPSAMPLE_NEAREST2X(site, module, x)
