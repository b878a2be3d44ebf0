"""A VAE convolution's bias added in one vectorised pass, bit-identical to aten's.

cuDNN's convolutions take no bias. For a module ``nn.Conv2d`` / ``nn.Conv3d`` with one, aten runs (Convolution.cpp,
``ConvBackend::Cudnn``)::

    output = at::cudnn_convolution(input.contiguous(memory_format), weight, padding, stride, dilation, groups, ...)
    output.add_(reshape_bias(input.dim(), bias))       # bias as [1, C, 1, 1(, 1)]: one fp32 add, rounded to T

and its elementwise kernel does not vectorise that broadcast add: on an H100 the 35 bias adds of a FLUX.1 decode at
1024x1024 take 6.6 ms of its 44 (the convolutions themselves 12.8), the Wan 2.1 decode's 754 take 125 ms. Here the
convolution runs without its bias (``conv._conv_forward(x, weight, None)``: the same ``cudnn_convolution`` call,
the backend asked of torch first) and ``csrc/conv_bias.cu`` adds the bias in place, 16 bytes per thread:
``x = round(float(x) + float(bias[c]))``, aten's add (``a + alpha * b`` with alpha 1). The result is the tensor
eager returns, in its layout (contiguous, or channels-last where cuDNN wrote that). Exact by construction; the
first call of each (dtype, layout) is still compared with the module's own forward (`FusedOp` verification), which
disables the op on a mismatch.

What the guard admits: a module of a class registered here (`add_bias_conv_class`: this package's subclasses of
``nn.Conv2d`` / ``nn.Conv3d`` and the VAEs' causal convolutions, whose forward runs this op on the input they
padded) whose torch ``forward`` is torch's own, with a bias, ``padding_mode`` "zeros" and integer padding; x a batched
bf16/fp16/fp32 input on CUDA (an fp32 VAE's too: the add is one fp32 add either way) of the weight's and bias's dtype
and device, not empty; a convolution torch runs with cuDNN
(``torch._C._select_conv_backend``, asked with the bias and without: both ``Cudnn``; grouped or depthwise ones
that go elsewhere are refused); no autograd. Anything else runs ``nn.ConvNd.forward`` as torch wrote it.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FLOAT_DTYPES, HALF_DTYPES, EagerClasses, FusedOp, Site, autograd_device_reason

_BASES = EagerClasses()  # the classes the op takes
SITE, NAMED_SITE = "_fastpath_site", "_fastpath_site_conv_bias"  # (`_state.site_attr`: a module patch gave a site)


def add_bias_conv_class(cls: type) -> None:
    """Let the guard take modules of `cls`: a subclass of ``nn.Conv2d`` or ``nn.Conv3d`` whose forward (or the
    padding around it) this package wrote and that adds no state."""
    _BASES.add(cls)


def _torch_conv(conv: nn.Module) -> type:
    """The torch class whose ``forward`` `conv` computes: ``nn.Conv3d`` or ``nn.Conv2d``."""
    return nn.Conv3d if isinstance(conv, nn.Conv3d) else nn.Conv2d


def conv_bias_ref(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The eager convolution: torch's ``nn.Conv2d.forward`` / ``nn.Conv3d.forward`` (the cuDNN call and its bias add)."""
    return _torch_conv(conv).forward(conv, x)


def _backend(conv: nn.Module, x: torch.Tensor, bias, padding=None) -> object:
    """The backend torch runs `conv`'s convolution of x with (its own padding, or `padding`: a buffer padded around
    x already, as LTX-2's reflecting decoder convolves)."""
    n = x.dim() - 2
    padding = conv.padding if padding is None else padding
    return torch._C._select_conv_backend(x, conv.weight, bias, list(conv.stride), list(padding),
                                         list(conv.dilation), False, [0] * n, conv.groups, None)


def _guard(conv: nn.Module, x: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    reason = _BASES.refusal(conv, "convolution")
    if reason is not None:
        return reason
    if SITE not in conv.__dict__ and NAMED_SITE not in conv.__dict__:
        return "not patched"  # (a module of the class made while patched, by someone else: PEFT's LoRA layers)
    weight, bias = getattr(conv, "weight", None), getattr(conv, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return "no bias"
    if not isinstance(weight, torch.Tensor) or getattr(conv, "padding_mode", None) != "zeros":
        return "padding mode"
    if not (isinstance(conv.padding, tuple) and all(isinstance(p, int) for p in conv.padding)):
        return "padding not integers"
    if not isinstance(x, torch.Tensor) or x.dim() != weight.dim():
        return "x not batched"
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if weight.dtype is not x.dtype or bias.dtype is not x.dtype:
        return "mixed dtypes"
    if x.numel() == 0:
        return "empty"
    reason = autograd_device_reason(x, weight, bias)
    if reason is not None:
        return reason
    if torch.compiler.is_compiling():  # (traced, the op is the module's own forward: no backend to ask)
        return None
    cudnn = torch._C._ConvBackend.Cudnn
    try:  # (aten checks the shapes first: a shape eager refuses raises there, and eager raises its own error)
        if _backend(conv, x, bias) != cudnn or _backend(conv, x, None) != cudnn:
            return "not a cuDNN convolution"
    except RuntimeError:
        return "shape"
    return None


def _layout(out: torch.Tensor) -> bool | None:
    """Channels-last (True), contiguous (False), or None for another layout of the convolution's output."""
    if out.is_contiguous():
        return False
    fmt = torch.channels_last if out.dim() == 4 else torch.channels_last_3d
    return True if out.is_contiguous(memory_format=fmt) else None


# The NVRTC way: csrc/conv_bias.cu's kernel, launched as its launch() and bindings.cpp's conv_bias_ do. Duplicated
# from there: kThreads 256, kMaxRowBlocks 65535 (tests/test_nvrtc.py reads them from the .cu), the ConvBiasArgs fields
# (fastpath.h), the 16-byte vector (8 elements of T); the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("ConvBiasArgs", ("x", "P"), ("bias", "P"), ("rows", "q"), ("cols", "q"), ("channels", "q"),
                      ("dtype", "i"), ("channels_last", "?"))
_NVRTC = _nvrtc.Kernel(
    "conv_bias.cu",
    "diffusers_fastpath::conv_bias_kernel",
    {(dtype, cl, vec): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(cl).lower()}, {str(vec).lower()}"
     for dtype in FLOAT_DTYPES for cl in (False, True) for vec in (False, True)},
    _nvrtc.Params("conv_bias_kernel", ("a", _ARGS)),
)
_THREADS = 256
_MAX_ROW_BLOCKS = 65535
_VEC_BYTES = 16  # a thread's vector: 8 elements of fp16 / bf16, 4 of fp32


def _nvrtc_kernel(x: torch.Tensor, bias: torch.Tensor) -> None:
    channels_last = bool(_layout(x))
    channels = x.shape[1]
    cols = channels if channels_last else x.numel() // (x.shape[0] * channels)
    rows = x.numel() // cols
    per_vector = _VEC_BYTES // x.element_size()
    vector = cols % per_vector == 0 and x.data_ptr() % _VEC_BYTES == 0
    vecs = (cols + per_vector - 1) // per_vector if vector else cols
    grid = ((vecs + _THREADS - 1) // _THREADS, min(rows, _MAX_ROW_BLOCKS), 1)
    _NVRTC.launch(x.device.index, (x.dtype, channels_last, vector), grid, (_THREADS, 1, 1), x.data_ptr(),
                  bias.data_ptr(), rows, cols, channels, _nvrtc.DTYPE_CODE[x.dtype], channels_last)


def _raw_guard(x, bias):
    # bindings.cpp's checks: a dense CUDA [N, C, *] of fp16 / bf16 / fp32, contiguous or channels-last; bias [C] of
    # its dtype
    if (x.dim() < 3 or x.dtype not in FLOAT_DTYPES or not x.is_cuda or bias.dim() != 1 or bias.shape[0] != x.shape[1]
            or bias.dtype != x.dtype or not bias.is_contiguous() or x.dim() > 5 or _layout(x) is None or not x.numel()):
        return "shape, dtype or layout"
    return None


_nvrtc.raw_op("_conv_bias_cuda_", "(Tensor(a!) x, Tensor bias) -> ()", _raw_guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_conv_bias_cuda_")

# csrc/conv_bias.cu's bias_contiguous_kernel (kTile 32, kTileRows 8; BiasContiguousArgs in fastpath.h): a channels-last
# output's bias added into a new contiguous tensor, the transpose in the same pass (`diffusers_fastpath.ops.causal_conv_cl`);
# its kResidual variant adds a contiguous residual to the rounded sum (`diffusers_fastpath.ops.conv_bias_residual`); and
# bias_contiguous_wide_kernel, the same values in 16-byte vectors both ways, where `wide_fits`
_CONTIGUOUS_ARGS = _nvrtc.Params("BiasContiguousArgs", ("out", "P"), ("x", "P"), ("bias", "P"), ("residual", "P"),
                                 ("batch", "q"), ("spatial", "q"), ("channels", "q"), ("residual_plane", "q"),
                                 ("dtype", "i"))
_NVRTC_CONTIGUOUS = _nvrtc.Kernel("conv_bias.cu", "diffusers_fastpath::bias_contiguous_kernel",
                                  {(dtype, residual): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(residual).lower()}"
                                   for dtype in FLOAT_DTYPES for residual in (False, True)},
                                  _nvrtc.Params("bias_contiguous_kernel", ("a", _CONTIGUOUS_ARGS)))
_NVRTC_CONTIGUOUS_WIDE = _nvrtc.Kernel("conv_bias.cu", "diffusers_fastpath::bias_contiguous_wide_kernel",
                                       {(dtype, residual): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(residual).lower()}"
                                        for dtype in HALF_DTYPES for residual in (False, True)},
                                       _nvrtc.Params("bias_contiguous_wide_kernel", ("a", _CONTIGUOUS_ARGS)))
_TILE, _TILE_ROWS = 32, 8
_WIDE_POSITIONS, _WIDE_CHANNELS, _WIDE_THREADS = 64, 32, 128  # the wide kernel's tile and block (kWide* in the .cu)


def residual_plane(residual: torch.Tensor) -> int | None:
    """csrc/fastpath.h's BiasContiguousArgs::residual_plane of a residual the kernels take: 0 contiguous, H * W
    time-major (a 5-D ``[B, C, T, H, W]`` laid out as ``[B, T, C, H, W]``: Wan's upsamplers' outputs), else None."""
    if residual.is_contiguous():
        return 0
    if residual.dim() == 5 and residual.permute(0, 2, 1, 3, 4).is_contiguous():
        return residual.shape[3] * residual.shape[4]
    return None


def wide_fits(x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, channels: int, spatial: int) -> bool:
    """csrc/conv_bias.cu's wide_fits, for 16-bit values: whole 16-byte vectors of x, the residual and out at every
    position and channel (a time-major residual's inside one frame's plane)."""
    return (x.dtype in HALF_DTYPES and channels % 8 == 0 and spatial % 8 == 0
            and all(t.data_ptr() % 16 == 0 for t in (x, out) + (() if residual is None else (residual,)))
            and (residual is None or residual_plane(residual) % 8 == 0))


def _nvrtc_contiguous(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        batch, channels = x.shape[:2]
        spatial = x.numel() // (batch * channels)
        key = (x.dtype, residual is not None)
        wide = wide_fits(x, out, residual, channels, spatial)
        kernel = _NVRTC_CONTIGUOUS_WIDE if wide else _NVRTC_CONTIGUOUS
        block = (_WIDE_THREADS, 1, 1) if wide else (_TILE, _TILE_ROWS, 1)
        positions, tile_c = (_WIDE_POSITIONS, _WIDE_CHANNELS) if wide else (_TILE, _TILE)
        grid = ((spatial + positions - 1) // positions, min((channels + tile_c - 1) // tile_c, _MAX_ROW_BLOCKS),
                min(batch, _MAX_ROW_BLOCKS))
        kernel.launch(x.device.index, key, grid, block, out.data_ptr(), x.data_ptr(), bias.data_ptr(),
                      0 if residual is None else residual.data_ptr(), batch, spatial, channels,
                      0 if residual is None else residual_plane(residual), _nvrtc.DTYPE_CODE[x.dtype])
    return out


def _raw_contiguous_guard(x, bias):
    # bindings.cpp's checks: a channels-last CUDA [N, C, *] (4 or 5 dims) of fp16 / bf16 / fp32; bias [C] of its dtype
    if (x.dim() not in (4, 5) or x.dtype not in FLOAT_DTYPES or not x.is_cuda or bias.dim() != 1
            or bias.shape[0] != x.shape[1] or bias.dtype != x.dtype or not bias.is_contiguous()
            or not x.is_contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
            and x.numel()):  # (as bindings.cpp asks: also true of a tensor contiguous both ways, C or S of 1)
        return "shape, dtype or layout"
    return None


def _raw_residual_guard(x, bias, residual):
    # bindings.cpp's checks: x and bias as above; residual a contiguous or time-major tensor of x's sizes, dtype and
    # device
    reason = _raw_contiguous_guard(x, bias)
    if reason is None and (residual.device != x.device or residual.shape != x.shape or residual.dtype != x.dtype
                           or residual_plane(residual) is None):
        reason = "residual"
    return reason


_nvrtc.raw_op("_conv_bias_contiguous_cuda", "(Tensor x, Tensor bias) -> Tensor", _raw_contiguous_guard,
              _nvrtc_contiguous)
_nvrtc.raw_op("_conv_bias_residual_contiguous_cuda", "(Tensor x, Tensor bias, Tensor residual) -> Tensor",
              _raw_residual_guard, _nvrtc_contiguous)

_contiguous_op = LazyLauncher(_nvrtc_contiguous, "_conv_bias_contiguous_cuda")
_residual_op = LazyLauncher(_nvrtc_contiguous, "_conv_bias_residual_contiguous_cuda")

# csrc/conv_bias.cu's bias_depth_to_space_kernel (kD2sWidth 32, kD2sChannels 8; BiasDepthToSpaceArgs in fastpath.h): a
# residual upsampler's output from its convolution's channels-last output, its bias and its input
# (`diffusers_fastpath.ops.ltx_upsampler`)
_D2S_ARGS = _nvrtc.Params("BiasDepthToSpaceArgs", ("out", "P"), ("x", "P"), ("bias", "P"), ("residual", "P"),
                          ("batch", "q"), ("channels", "q"), ("groups", "q"), ("frames", "q"), ("height", "q"),
                          ("width", "q"), ("dtype", "i"))
_NVRTC_D2S = _nvrtc.Kernel("conv_bias.cu", "diffusers_fastpath::bias_depth_to_space_kernel",
                           {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
                           _nvrtc.Params("bias_depth_to_space_kernel", ("a", _D2S_ARGS)))
_D2S_WIDTH, _D2S_CHANNELS = 32, 8


def _nvrtc_depth_to_space(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    batch, channels, frames, height, width = x.shape
    out = torch.empty((batch, channels // 8, 2 * frames - 1, 2 * height, 2 * width), dtype=x.dtype, device=x.device)
    if out.numel():
        tiles = -(-width // _D2S_WIDTH) * -(-(channels // 8) // _D2S_CHANNELS)
        grid = (tiles, min(batch * frames * height, _MAX_ROW_BLOCKS), 1)
        _NVRTC_D2S.launch(x.device.index, x.dtype, grid, (_D2S_WIDTH, _D2S_CHANNELS, 1), out.data_ptr(), x.data_ptr(),
                          bias.data_ptr(), residual.data_ptr(), batch, channels // 8, residual.shape[1] // 8, frames,
                          height, width, _nvrtc.DTYPE_CODE[x.dtype])
    return out


def _raw_depth_to_space_guard(x, bias, residual):
    # bindings_vae.cpp's checks: x a 16-byte aligned channels-last CUDA [N, 8 C, T, H, W] of fp16 / bf16, T > 0; bias
    # [8 C] of its dtype; residual a contiguous [N, 8 G, T, H, W] of its dtype and device, G dividing C
    if (x.dim() != 5 or x.dtype not in HALF_DTYPES or not x.is_cuda or x.shape[1] % 8 or not x.shape[2]
            or bias.dim() != 1 or bias.shape[0] != x.shape[1] or bias.dtype != x.dtype or not bias.is_contiguous()
            or not x.is_contiguous(memory_format=torch.channels_last_3d) or x.data_ptr() % 16):
        return "shape, dtype or layout"
    if (residual.device != x.device or residual.dim() != 5 or residual.shape[0] != x.shape[0]
            or residual.shape[1] % 8 or not residual.shape[1] or (x.shape[1] // 8) % (residual.shape[1] // 8)
            or residual.shape[2:] != x.shape[2:] or residual.dtype != x.dtype or not residual.is_contiguous()):
        return "residual"
    return None


_nvrtc.raw_op("_conv_bias_depth_to_space_cuda", "(Tensor x, Tensor bias, Tensor residual) -> Tensor",
              _raw_depth_to_space_guard, _nvrtc_depth_to_space)

_depth_to_space_op = LazyLauncher(_nvrtc_depth_to_space, "_conv_bias_depth_to_space_cuda")


def bias_contiguous_arithmetic(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What ``csrc/conv_bias.cu``'s bias_contiguous_kernel writes, in torch (the tests' emulation): aten's add of the
    bias (one fp32 add rounded to x's dtype), in a contiguous tensor."""
    return (x + bias.reshape(1, -1, *([1] * (x.dim() - 2)))).contiguous()


def bias_residual_contiguous_arithmetic(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                        biased=bias_contiguous_arithmetic) -> torch.Tensor:
    """What its kResidual variant writes, in torch (the tests' emulation): eager's tensor ``biased(x, bias)`` (aten's
    bias add, rounded to x's dtype), then aten's add of the residual (one fp32 add, rounded again)."""
    return biased(x, bias) + residual


def depth_to_space_residual_arithmetic(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                       biased=bias_contiguous_arithmetic) -> torch.Tensor:
    """What bias_depth_to_space_kernel writes, in torch (the tests' emulation): eager's tensor ``biased(x, bias)``
    (aten's bias add, rounded to x's dtype) and the input `residual`, each moved by the upsampler's depth-to-space
    (2x2x2; the residual's channels repeated to the output's), the first frame dropped, then aten's add (rounded
    again)."""
    def spread(t):
        b, c, frames, h, w = t.shape
        return t.reshape(b, c // 8, 2, 2, 2, frames, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(
            b, c // 8, 2 * frames, 2 * h, 2 * w)[:, :, 1:]

    out = spread(biased(x, bias))
    return out + spread(residual).repeat(1, out.shape[1] // (residual.shape[1] // 8), 1, 1, 1)


def bias_contiguous(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A channels-last convolution output ``x`` with ``bias`` added, as a new contiguous tensor: aten's
    ``x.add_(bias)`` then ``.contiguous()``, in one pass (for inputs `_raw_contiguous_guard` admits)."""
    return _contiguous_op(x, bias)


def bias_residual_contiguous(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`bias_contiguous`'s tensor plus ``residual`` (x's shape and dtype, contiguous or time-major: `residual_plane`),
    as a new contiguous tensor:
    aten's ``x.add_(bias)``, ``.contiguous()`` and ``+ residual``, each rounded as eager rounds it, in one pass (for
    inputs `_raw_residual_guard` admits)."""
    return _residual_op(x, bias, residual)


def bias_depth_to_space(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A residual upsampler's output (stride (2, 2, 2)) from its convolution's channels-last output ``x`` without the
    bias: ``x.add_(bias)``, the depth-to-space of its channels and of ``residual``'s (repeated to x's), the first frame
    dropped and the add, each rounded as eager rounds it, in one pass, contiguous (for inputs
    `_raw_depth_to_space_guard` admits)."""
    return _depth_to_space_op(x, bias, residual)


def _kernel(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = conv._conv_forward(x, conv.weight, None)
    bias = conv.bias
    if out.dim() > 5 or _layout(out) is None or not bias.is_contiguous():  # (not what cuDNN writes: aten's own add)
        return out.add_(bias.reshape(1, -1, *([1] * (out.dim() - 2))))
    _cuda_op(out, bias)
    return out


CONV_BIAS = FusedOp(
    "conv_bias",
    ref=conv_bias_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=conv_bias_ref,  # (torch.compile sees the module's own convolution)
    verify_key=lambda conv, x: (str(x.dtype).removeprefix("torch."), x.dim(),
                                not x.is_contiguous()),  # once per dtype and layout: exact by construction
)


def conv_bias(conv: nn.Module, x: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``nn.Conv2d.forward(conv, x)`` / ``nn.Conv3d.forward(conv, x)`` for a convolution with a bias, its bias added
    on CUDA in one vectorised pass, bit-identical to eager.

    Args:
        conv: the convolution module (a class registered with `add_bias_conv_class`).
        x: the batched input, as the convolution takes it (already padded by a causal convolution's forward).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return CONV_BIAS(site, conv, x)
