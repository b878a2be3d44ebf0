"""The input of Wan's and Qwen-Image's causal 3D convolutions (diffusers' ``WanCausalConv3d``,
``QwenImageCausalConv3d``) built in one buffer: the values only move, so the convolution gets the same tensor and
gives the same bits.

The module's forward (checked by source digest by the VAE adapter) runs, for x ``[B, C, T, H, W]`` and the cached
last frames of the previous chunk ``cache_x`` ``[B, C, t, H, W]``::

    x = torch.cat([cache_x, x], dim=2)         # when a cache is given and the conv pads in time: a copy of both
    x = F.pad(x, (w, w, h, h, 2p - t, 0))      # a new tensor: every element written with 0, then x copied in
    return nn.Conv3d.forward(self, x)

Per 3x3x3 convolution that is three full writes and two full reads of its input before cuDNN reads it (the decode
of Wan 2.1 at 832x480x81 spends 479 ms of 1836 in such copies on the H200). Here ``csrc/causal_pad.cu`` writes the
padded tensor in one pass, each output element the cache's, x's or a zero: one read and one write of the input
(zero fills and strided copies before it, which aten's elementwise kernel does not vectorise: 195 ms of the Wan
decode's 1.58 s on an H100). Where the convolution pads nothing and no cache is concatenated (the 1x1x1 shortcuts, the encoder's
temporal downsampling), ``F.pad`` would return a copy of x (``constant_pad_nd`` clones when no pad is positive, its
strides preserved where x is dense, contiguous where not) and x itself goes to the convolution where it is dense
and as aligned as a fresh block (``x.contiguous()`` where it is not dense). The padded tensor has the layout eager's has (contiguous; the guard refuses where
one eager would lay out channels-last), so cuDNN sees the same problem.

The buffer may exist before the call: the norm -> SiLU pair before a Wan residual block's convolution
(`diffusers_fastpath.ops.channel_rmsnorm_silu`) writes its result into the padded channels-last buffer of the
convolution that reads it and hands on the view of its positions (`interior_view`: the values the pair computes, in
another layout). Given that view (`interior_of`: exactly the part of such a buffer made for this convolution's
padding), the channels-last path (`diffusers_fastpath.ops.causal_conv_cl`) writes the cache's frames (and zeros before
them) into the buffer's first frames (`fill_front`: the values only move) and convolves the buffer; nothing else is
built. Such a view stands for a contiguous tensor of the same values (eager's pair result): where this op or the
channels-last one does not take it, the module's forward runs on ``x.contiguous()`` (`as_eager`), which is eager's
computation exactly (``F.pad`` of the view itself would lay its result out channels-last). A cache cloned from such a
view (``x[:, :, -CACHE_T:].clone()`` in diffusers' blocks) is laid out channels-last too; eager concatenates it to a
contiguous x, which gives a contiguous tensor of the same values whatever the cache's layout.

What the guard admits: a module of a class the adapter registered (`add_conv_class`), x of 5 dims on CUDA in a layout
eager reads as contiguous (contiguous itself where nothing is padded) or the view of a buffer made for this
convolution (`interior_of`), fp16 / bf16 / fp32 where a buffer is built (any dtype where x itself goes to the
convolution), ``cache_x`` ``None`` or a 5-dim tensor of any layout (one not read along W is made contiguous first) of
x's dtype, device and sizes but time, at most as many frames as the time padding; no autograd. Anything else runs the module's forward as diffusers wrote
it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FLOAT_DTYPES, HALF_DTYPES, EagerClasses, FusedOp, Site
from .conv_bias import NAMED_SITE as _BIAS_SITE  # (the convolution's named conv_bias site)
from .conv_bias import conv_bias

_ALLOCATOR_ALIGNMENT = 512  # the CUDA caching allocator's block alignment: the address of eager's clone
_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one


def add_conv_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' class (`base` None) once its ``forward`` was checked to be the
    one documented above and its parent's ``forward`` is ``nn.Conv3d.forward``, or this package's subclass of
    `base` that adds no state and whose forward runs this op."""
    _BASES.add(cls, base)


def causal_conv3d_ref(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """The eager forward: the diffusers class's (so that this package's subclass falls back to diffusers' code), on
    eager's x (`as_eager`: the contiguous tensor a padded result's view stands for)."""
    return _BASES.eager(conv).forward(conv, as_eager(x), cache_x)


# --- a buffer made before the call (the norm's padded result) --------------------------------------------------------

_INTERIOR = "_diffusers_fastpath_interior"  # on a buffer `interior_view` made: the padding its view is inside


def interior_view(buf: torch.Tensor, padding) -> torch.Tensor:
    """The view of `buf` (a ``[B, C, T', H', W']`` buffer of a causal convolution's input, laid out channels-last) at
    the positions of x, inside `padding` (the convolution's ``_padding``: w0, w1, h0, h1, t0, t1; t0 the frames of
    the cache and the zeros before them); `buf` marked as made for that padding (`interior_of`). What a producer that
    writes its result into the buffer (`diffusers_fastpath.ops.channel_rmsnorm_silu`) returns."""
    pw0, pw1, ph0, ph1, pt0, pt1 = padding
    setattr(buf, _INTERIOR, tuple(padding))
    frames, height, width = buf.shape[2:]
    return buf[:, :, pt0:frames - pt1, ph0:height - ph1, pw0:width - pw1]


def interior_of(x: torch.Tensor, conv: nn.Module) -> torch.Tensor | None:
    """The buffer x is exactly the `interior_view` of, made for `conv`'s padding, or ``None`` (x anything else: a
    tensor of its own, a view of another tensor or of another part of such a buffer)."""
    base = x._base
    if base is None or getattr(base, _INTERIOR, None) != getattr(conv, "_padding", ()):
        return None
    pw0, _, ph0, _, pt0, _ = conv._padding
    offset = (pt0 * base.stride(2) + ph0 * base.stride(3) + pw0 * base.stride(4)) * base.element_size()
    if (x.dim() != 5 or tuple(base.shape) != padded_shape(x, conv._padding) or x.stride() != base.stride()
            or x.data_ptr() != base.data_ptr() + offset):
        return None
    return base


def as_eager(x):
    """The tensor eager would have where x is (a part of) a buffer `interior_view` made: ``x.contiguous()``, the same
    values contiguous (a pair's result, and slices of it, are contiguous-format in eager); else x itself."""
    base = getattr(x, "_base", None)
    return x.contiguous() if base is not None and hasattr(base, _INTERIOR) else x


def fill_front(buf: torch.Tensor, padding, cache_x: torch.Tensor | None) -> torch.Tensor:
    """`buf` with its first ``padding[4]`` frames inside the border made eager's: the cache's frames last (where the
    convolution pads in time, as eager concatenates them), zeros before them; the border (zeros) is the producer's.
    The values only move (an aten copy of any layout), so the buffer is eager's padded input."""
    pw0, pw1, ph0, ph1, pt0, _ = padding
    cached = 0 if cache_x is None or pt0 <= 0 else cache_x.shape[2]
    front = buf[:, :, :pt0, ph0:buf.shape[3] - ph1, pw0:buf.shape[4] - pw1]
    if cached < pt0:
        front[:, :, :pt0 - cached].zero_()
    if cached:
        dst, src = _words(front[:, :, pt0 - cached:]), _words(cache_x)
        if dst is not None and src is not None:  # (the same bytes, moved 8 at a time: a fourth of the instructions)
            dst.copy_(src)
        else:
            front[:, :, pt0 - cached:].copy_(cache_x)
    return buf


def cloned(t):
    """``t.clone()``, the same tensor (values, dtype, shape, strides: ``torch.empty_like``'s, which ``clone`` makes),
    with the values moved as 8-byte words where `_words` takes both (a cache cut from an `interior_view`, ``x[:, :,
    -CACHE_T:].clone()`` in diffusers' blocks: rows of ``W * C`` values with the border between them, which aten's
    strided copy moves one 2-byte value a thread). Anything else, a tensor that needs autograd, a subclass, one that
    is dense (aten's copy is vectorised there), or under ``torch.compile``, is ``t.clone()`` itself."""
    if (type(t) is not torch.Tensor or t.requires_grad or torch.compiler.is_compiling() or _dense(t)
            or (src := _words(t)) is None):
        return t.clone()
    out = torch.empty_like(t)
    dst = _words(out)
    if dst is None or dst.shape != src.shape:
        return t.clone()
    dst.copy_(src)
    return out


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """A channels-last ``[B, C, T, H, W]`` tensor (rows of ``W * C`` values contiguous: a buffer's part, a cache cloned
    from one) as its ``[B, T, H, W * C * size / 8]`` int64 words, where its rows, their strides and its address are
    whole words; else ``None``. What `fill_front` copies: aten moves a strided copy one element a thread, and the
    Wan decode's caches are 2-byte values (about 60 ms of its copies on an H100 moved that way)."""
    rows = t.movedim(1, -1)
    if t.numel() == 0 or rows.stride(-1) != 1 or rows.stride(-2) != t.shape[1]:
        return None
    rows = rows.flatten(-2)  # (a view: W and C are one run of memory)
    size = t.element_size()
    if (rows.shape[-1] * size) % 8 or (t.storage_offset() * size) % 8 or any((s * size) % 8 for s in rows.stride()[:-1]):
        return None
    return rows.view(torch.int64)


def _contiguous_format(t: torch.Tensor) -> bool:
    """Whether eager's ``suggest_memory_format`` reads `t` (5 dims, any strides) as contiguous, not channels-last:
    aten's ``is_channels_last_strides_3d`` walks C, W, H, T, N and needs each stride at least the previous one times
    its size, so a unit W stride below C's stride times C (more than 1) rules it out. Then ``torch.cat`` (every
    input contiguous-format) and ``F.pad`` (``constant_pad_nd``: ``at::empty`` in that format) give contiguous
    tensors, as the one buffer is."""
    return t.stride(4) == 1 and t.stride(1) * max(t.shape[1], 1) > 1 and t.numel() > 0


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps or overlaps (its strides a permutation of a contiguous
    tensor's): ``clone`` then keeps its strides (``preserve_format``)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return t.numel() > 0


def _pads(conv, cache_x) -> bool:
    """Whether eager builds a new input at all (a cache concatenated, or some padding)."""
    padding = conv._padding
    return (cache_x is not None and padding[4] > 0) or any(padding)


def padded_shape(x: torch.Tensor, padding) -> tuple[int, ...]:
    """The shape of the buffer the convolution reads: x's ``[B, C, T, H, W]`` with `padding` (``F.pad``'s order, w0, w1,
    h0, h1, t0, t1; t0 counting the cache's frames) around its last three dimensions."""
    batch, channels, frames, height, width = x.shape
    return (batch, channels, frames + padding[4] + padding[5], height + padding[2] + padding[3],
            width + padding[0] + padding[1])


def _guard(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None, check_pointers: bool = True) -> str | None:
    """``None`` when the one-buffer build takes these inputs, else the reason it does not (counted at the site)."""
    reason = _BASES.refusal(conv, "causal convolution")
    if reason is not None:
        return reason
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return "x not [B, C, T, H, W]"
    padding = getattr(conv, "_padding", None)
    if not (isinstance(padding, tuple) and len(padding) == 6 and all(isinstance(p, int) and p >= 0 for p in padding)):
        return "padding not six non-negative ints"
    if tuple(conv.padding) != (0, 0, 0):
        return "the convolution pads itself"
    # a convolution eager refuses (x of another channel count, a padded input smaller than the kernel's extent): eager
    # raises its error. Refused here, the error comes from the fallback, not from inside the kernel, which `FusedOp`
    # would take for a kernel failure and disable this op (and causal_conv3d_cl) for the process.
    weight = getattr(conv, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 5 or x.shape[1] != weight.shape[1] * conv.groups:
        return "shape"
    if any(size < d * (k - 1) + 1 for size, k, d in zip(padded_shape(x, padding)[2:], weight.shape[2:], conv.dilation)):
        return "shape"
    inside = interior_of(x, conv) is not None  # (the view of a buffer made for this convolution)
    if not _pads(conv, cache_x):
        # eager's F.pad returns x.clone(): x's strides (x dense), on a fresh 512-byte aligned block. x itself has
        # the same strides; the convolution gets it where its address is as aligned (checked last, on the GPU).
        if not (_dense(x) or _contiguous_format(x)):  # (not dense: the clone is contiguous, as x.contiguous())
            return "x of a channels-last layout"
    elif not (inside or _contiguous_format(x)):
        return "x of a channels-last layout"
    elif x.dtype not in FLOAT_DTYPES:  # (the buffer's kernel copies fp16 / bf16 / fp32; x itself goes anywhere)
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if cache_x is not None and padding[4] > 0:
        if not isinstance(cache_x, torch.Tensor) or cache_x.dim() != 5:
            return "cache not [B, C, t, H, W]"
        if cache_x.dtype != x.dtype or cache_x.device != x.device:
            return "cache of another dtype or device"
        if cache_x.shape[:2] != x.shape[:2] or cache_x.shape[3:] != x.shape[3:] or cache_x.shape[2] > padding[4]:
            return "cache shape"
        if torch.is_grad_enabled() and cache_x.requires_grad:
            return "requires grad"
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in conv.parameters(recurse=False))):
        return "requires grad"
    if not x.is_cuda:
        return f"device {x.device.type}"
    if check_pointers and not _pads(conv, cache_x) and _dense(x) and x.data_ptr() % _ALLOCATOR_ALIGNMENT:
        return "x not aligned as a fresh block"
    return None


def padded_input(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None,
                 channels_last: bool = False) -> torch.Tensor:
    """``F.pad(torch.cat([cache_x, x], dim=2), padding)`` as the module computes it, written into one buffer by
    ``csrc/causal_pad.cu`` (x itself where nothing is padded or concatenated), contiguous as eager's, or laid out
    channels-last (the same values; `diffusers_fastpath.ops.causal_conv_cl`, where something is padded)."""
    if cache_x is None or conv._padding[4] <= 0:
        cache_x = None  # eager concatenates only where the convolution pads in time
    elif cache_x.shape[4] > 1 and cache_x.stride(4) != 1:
        # (a cache cloned from a padded result's view, laid out channels-last: eager's concatenation with a
        # contiguous-format x is contiguous whatever the cache's layout, and the kernel reads rows along W)
        cache_x = cache_x.contiguous()
    if cache_x is None and not any(conv._padding):
        return x if _dense(x) else x.contiguous()  # what eager's clone is: x's strides where dense, else contiguous
    return _launch(x, cache_x, list(conv._padding), channels_last)


def _source_index(size: int, before: int, after: int, mode: str) -> torch.Tensor:
    """Per position of a padded axis, the source position the kernel reads (``size``: none, a zero): inside, its
    own; on the border ``size`` (zeros), the nearest end ("clamp": the repeated first and last frames), or F.pad's
    reflection ("reflect": -i from i, size - 1 + i from size - 1 - i)."""
    i = torch.arange(-before, size + after)
    if mode == "clamp":
        return i.clamp(0, size - 1)
    if mode == "reflect":
        return torch.where(i < 0, -i, torch.where(i >= size, 2 * (size - 1) - i, i))
    return torch.where((i >= 0) & (i < size), i, size)


def pad_arithmetic(x: torch.Tensor, cache_x: torch.Tensor | None, padding: list[int], channels_last: bool = False,
                   replicate_t: bool = False, reflect_hw: bool = False) -> torch.Tensor:
    """What ``csrc/causal_pad.cu`` writes, in torch (the tests' emulation of the kernel): the cache frames, then x's,
    each output element gathered from the source position the kernel computes for it (`_source_index`), a zero on a
    zero border (the source with a zero appended on each axis); contiguous, or channels-last (``channels_last_3d``).
    The border is zeros, or in time the first and last frames (`replicate_t`), in space F.pad's reflection
    (`reflect_hw`)."""
    pw0, pw1, ph0, ph1, pt0, pt1 = padding
    source = x if cache_x is None else torch.cat([cache_x, x], dim=2)
    frames, height, width = source.shape[2:]
    out = F.pad(source, (0, 1, 0, 1, 0, 1))  # (+0.0 at index size of each axis, as the kernel writes on the border)
    for dim, index in ((2, _source_index(frames, pt0 - (frames - x.shape[2]), pt1, "clamp" if replicate_t else "")),
                       (3, _source_index(height, ph0, ph1, "reflect" if reflect_hw else "")),
                       (4, _source_index(width, pw0, pw1, "reflect" if reflect_hw else ""))):
        out = out.index_select(dim, index)
    return out.contiguous(memory_format=torch.channels_last_3d if channels_last else torch.contiguous_format)


# The NVRTC way: csrc/causal_pad.cu's kernels, launched as its launch() and bindings.cpp's causal_pad do. Duplicated
# from there: kThreads 256, kMaxRowBlocks 65535, kTile 32, kTileRows 8 (tests/test_vae_wan.py reads them from the .cu),
# the CausalPadArgs fields (fastpath.h), the instantiation that reads the mode flags where one is set, and the output
# allocation; the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("CausalPadArgs", ("out", "P"), ("x", "P"), ("cache", "P"), ("batch", "q"), ("channels", "q"),
                      ("frames", "q"), ("height", "q"), ("width", "q"), ("cache_frames", "q"), ("pad_t0", "q"),
                      ("pad_t1", "q"), ("pad_h0", "q"), ("pad_h1", "q"), ("pad_w0", "q"), ("pad_w1", "q"),
                      ("x_stride_b", "q"), ("x_stride_c", "q"), ("x_stride_t", "q"), ("x_stride_h", "q"),
                      ("cache_stride_b", "q"), ("cache_stride_c", "q"), ("cache_stride_t", "q"),
                      ("cache_stride_h", "q"), ("dtype", "i"), ("channels_last", "?"), ("replicate_t", "?"),
                      ("reflect_hw", "?"))


def _kernel_of(name: str, modes: bool, dtypes=FLOAT_DTYPES) -> _nvrtc.Kernel:
    """The instantiations of `name` per dtype of `dtypes`: kModes false (the zero border: Wan's) or true (the mode
    flags read)."""
    return _nvrtc.Kernel("causal_pad.cu", f"diffusers_fastpath::{name}",
                         {dtype: f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(modes).lower()}" for dtype in dtypes},
                         _nvrtc.Params(name, ("a", _ARGS)))


_NVRTC, _NVRTC_MODES = (_kernel_of("causal_pad_kernel", modes) for modes in (False, True))
_NVRTC_CL, _NVRTC_CL_MODES = (_kernel_of("causal_pad_cl_kernel", modes) for modes in (False, True))
_NVRTC_WIDE, _NVRTC_WIDE_MODES = (_kernel_of("causal_pad_cl_wide_kernel", modes, HALF_DTYPES)
                                  for modes in (False, True))
_THREADS = 256
_MAX_ROW_BLOCKS = 65535
_TILE, _TILE_ROWS = 32, 8
_WIDE_CHANNELS, _WIDE_COLUMNS, _WIDE_THREADS = 32, 64, 128  # the wide kernels' tile and block (kWide* in the .cu)


def _aligned(t: torch.Tensor | None) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def wide_fits(x: torch.Tensor, cache_x: torch.Tensor | None, out: torch.Tensor,
              rsqrt: torch.Tensor | None = None) -> bool:
    """csrc/causal_pad.cu's wide_fits, for 16-bit values: whole 16-byte vectors of x, of the cache, of `rsqrt` and of
    the channels-last output at every row and column the wide kernels read and write."""
    if x.dtype not in HALF_DTYPES or x.shape[1] % 8 or x.shape[4] == 0 or x.shape[4] % 8 or not _aligned(x):
        return False
    if not _aligned(out) or any(s % 8 for s in x.stride()[:4]):
        return False
    if cache_x is not None and cache_x.shape[2] > 0 and (not _aligned(cache_x)
                                                         or any(s % 8 for s in cache_x.stride()[:4])):
        return False
    return _aligned(rsqrt)


def launch_fields(x: torch.Tensor, cache_x: torch.Tensor | None, padding: list[int], channels_last: bool = False,
                  replicate_t: bool = False, reflect_hw: bool = False,
                  rsqrt: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple, bool, tuple, tuple]:
    """What bindings_vae.cpp's causal_pad_args makes for these arguments and the .cu's launcher picks: the output the
    kernels write (its padded shape, contiguous or channels-last), the CausalPadArgs fields in order, whether the wide
    channels-last kernel runs (`wide_fits`), and its grid and block (channels-last: a tile of `_WIDE_CHANNELS`
    channels x `_WIDE_COLUMNS` columns a block of `_WIDE_THREADS`, or of `_TILE` x `_TILE`; else `_THREADS` columns
    a block). Also the launch of `diffusers_fastpath.ops.ltx_vae_rmsnorm_conv`'s kernels, which take these arguments
    and `rsqrt`."""
    pw0, pw1, ph0, ph1, pt0, pt1 = padding
    ct = 0 if cache_x is None else cache_x.shape[2]
    batch, channels, frames, height, width = x.shape
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    out = torch.empty(batch, channels, pt0 + frames + pt1, height + ph0 + ph1, width + pw0 + pw1, dtype=x.dtype,
                      device=x.device, memory_format=fmt)
    planes = out.shape[0] * out.shape[2] * out.shape[3]

    def tile_grid(columns: int, column_tile: int, channel_tile: int) -> tuple:  # (the .cu's tile_grid)
        return ((columns + column_tile - 1) // column_tile,
                min((channels + channel_tile - 1) // channel_tile, _MAX_ROW_BLOCKS), min(planes, _MAX_ROW_BLOCKS))

    wide = channels_last and wide_fits(x, cache_x, out, rsqrt)
    if wide:  # (the source columns: the border is the first tile's)
        grid, block = tile_grid(width, _WIDE_COLUMNS, _WIDE_CHANNELS), (_WIDE_THREADS, 1, 1)
    elif channels_last:
        grid, block = tile_grid(out.shape[4], _TILE, _TILE), (_TILE, _TILE_ROWS, 1)
    else:
        grid = ((out.shape[4] + _THREADS - 1) // _THREADS, min(planes * channels, _MAX_ROW_BLOCKS), 1)
        block = (_THREADS, 1, 1)
    cache_ptr, cache_strides = (0, (0, 0, 0, 0)) if cache_x is None else (cache_x.data_ptr(), cache_x.stride()[:4])
    fields = (out.data_ptr(), x.data_ptr(), cache_ptr, batch, channels, frames, height, width, ct, pt0 - ct, pt1, ph0,
              ph1, pw0, pw1, *x.stride()[:4], *cache_strides, _nvrtc.DTYPE_CODE[x.dtype], channels_last, replicate_t,
              reflect_hw)
    return out, fields, wide, grid, block


def _nvrtc_kernel(x: torch.Tensor, cache_x: torch.Tensor | None, padding: list[int], channels_last: bool = False,
                  replicate_t: bool = False, reflect_hw: bool = False) -> torch.Tensor:
    out, fields, wide, grid, block = launch_fields(x, cache_x, padding, channels_last, replicate_t, reflect_hw)
    if out.numel():
        modes = replicate_t or reflect_hw
        if wide:
            kernel = _NVRTC_WIDE_MODES if modes else _NVRTC_WIDE
        elif channels_last:
            kernel = _NVRTC_CL_MODES if modes else _NVRTC_CL
        else:
            kernel = _NVRTC_MODES if modes else _NVRTC
        kernel.launch(x.device.index, x.dtype, grid, block, *fields)
    return out


def _raw_guard(x, cache_x, padding, channels_last=False, replicate_t=False, reflect_hw=False):
    # bindings.cpp's checks: CUDA [B, C, T, H, W] of fp16 / bf16 / fp32 with unit W stride, a like cache of at most
    # the time padding's frames, six non-negative paddings; reflected ones below their dimension's size, a frame to
    # repeat
    def fits(t):
        return t.dim() == 5 and t.dtype in FLOAT_DTYPES and t.is_cuda and (t.shape[4] <= 1 or t.stride(4) == 1)

    if not fits(x) or len(padding) != 6 or any(p < 0 for p in padding):
        return "shape, dtype, layout or padding"
    if cache_x is not None and not (fits(cache_x) and cache_x.dtype == x.dtype and cache_x.shape[2] <= padding[4]
                                    and cache_x.shape[:2] == x.shape[:2] and cache_x.shape[3:] == x.shape[3:]):
        return "cache shape, dtype or layout"
    if reflect_hw and not (max(padding[:2]) < x.shape[4] and max(padding[2:4]) < x.shape[3]):
        return "a reflected padding not below its dimension's size"
    if replicate_t and x.shape[2] == 0 and (cache_x is None or cache_x.shape[2] == 0):
        return "no frame to repeat"
    return None


_nvrtc.raw_op("_causal_pad_cuda", "(Tensor x, Tensor? cache, int[] padding, bool channels_last=False, "
              "bool replicate_t=False, bool reflect_hw=False) -> Tensor", _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_causal_pad_cuda")


_CHANNELS_LAST: list = []  # (op, site attribute): the channels-last path, `causal_conv_cl` (registered on its import)


def register_channels_last(op: FusedOp, site: str) -> None:
    """Let the convolutions that carry `site` try `op` (`diffusers_fastpath.ops.causal_conv_cl`) first."""
    _CHANNELS_LAST[:] = [(op, site)]


def _kernel(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    # channels-last where `causal_conv_cl` takes it (its own site, guard and per-signature check), else the
    # convolution, ``nn.Conv3d.forward``, its bias added by `conv_bias` (its own site, its own guard)
    for op, attr in _CHANNELS_LAST:
        site = conv.__dict__.get(attr)  # (a site only on the convolutions that pad, with a bias)
        out = None if site is None else op.try_fast(site, conv, x, cache_x)
        if out is not None:
            return out
    if interior_of(x, conv) is not None:  # (refused channels-last: the contiguous tensor of the same values)
        x = x.contiguous()
    return conv_bias(conv, padded_input(conv, x, cache_x), conv.__dict__.get(_BIAS_SITE))


def _custom_op(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """Under ``torch.compile``: the module's own forward (the compiler sees aten's concatenation and padding)."""
    return causal_conv3d_ref(conv, x, cache_x)


CAUSAL_CONV3D = FusedOp("causal_conv3d", ref=causal_conv3d_ref, guard=_guard, kernel=_kernel, custom_op=_custom_op)


def causal_conv3d(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None,
                  site: Site | None = None) -> torch.Tensor:
    """``conv(x, cache_x)`` for Wan's / Qwen-Image's causal convolution, its padded input built in one buffer (exact
    by construction: the values only move).

    Args:
        conv: the module (``WanCausalConv3d`` or ``QwenImageCausalConv3d``, registered by the VAE adapter).
        x: ``[B, C, T, H, W]`` activations.
        cache_x: the previous chunk's last frames (``None`` for none), as the module takes them.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return CAUSAL_CONV3D(site, conv, x, cache_x)
