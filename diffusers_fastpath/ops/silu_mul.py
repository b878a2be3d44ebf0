"""SwiGLU's elementwise half, ``F.silu(gate) * up``, in one pass (FLUX.2's ``Flux2SwiGLU`` on the two
``chunk(2, dim=-1)`` halves of one projection; the same line in other feed-forwards).

Formula and rounding points (T = fp16 or bf16, fp32 arithmetic, ``round`` to nearest even in T), those of the two
eager kernels it replaces::

    out = round(round(gate / (1 + exp(-gate))) * up)

The SiLU is aten's ``silu_kernel`` expression with CUDA's ``expf``; it is a function of one 16-bit value, so on its
first call per dtype the op runs all 65536 bit patterns through the kernel and through eager ``F.silu`` and compares
the bits (as `gelu_cat` proves its GELU), and the SiLU of the fp32 upcast rounded back (diffusers' ``FP32SiLU``) too:
equal, or the op disables itself for the process with one warning and runs the eager expression. The multiply is exact by construction. The kernel is ``csrc/silu_mul.cu``; it reads each
input once and writes once (eager: the SiLU reads and writes, the multiply reads two and writes).

Shapes: ``gate`` and ``up`` are ``[B, L, D]`` with unit innermost stride and 16-byte aligned rows (any row and batch
strides that keep them so: the halves of a contiguous ``[B, L, 2D]`` qualify without a copy); the output is
contiguous, so `silu_mul` takes rows only where eager's product is contiguous too (it is laid out after ``gate``:
rows in their own order, not ``[B, L, D]`` rows of ``[L, B, D]`` memory; `_policy.laid_out_contiguous`). Packed
``[N, D]`` rows (Cosmos 3's feed-forwards over its packed sequence) are taken as ``[1, N, D]``: the kernel indexes
them the same way, and the result is the ``[N, D]`` view of its output. Channel-split feature maps
``[B, C, *S]`` (Sana's ``GLUMBConv``: ``x * silu(gate)`` on the ``chunk(2, dim=1)`` halves of a convolution's
channels-last output) are taken as the kernel's rows in their memory order, ``[B, prod(S), C]`` or ``[B, C, prod(S)]``
(`_rows_of`), and the result laid out as eager lays it out.

`swiglu_cat` is the same kernel where a concatenation follows the SwiGLU (FLUX.2's parallel single blocks:
``torch.cat([attn_output, swiglu(mlp)], dim=-1)`` before the output projection): it writes the SwiGLU straight into
its columns of the concatenation buffer (the kernel's output rows may be strided) and copies the attention output
into the others, so the activation is never written, read back and copied (eager: SiLU, multiply, cat).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.activations import FP32SiLU
from torch import nn

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, REASON_LAYOUT, FusedOp, Site, bits, layout_laid_out_contiguous
from .gelu_cat import every_value

_VEC_BYTES = 16


SILUS = (nn.SiLU, FP32SiLU)  # the activation modules the kernel stands for (its proof checks both on every value)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor, act: nn.Module | None = None,
                 up_first: bool = False) -> torch.Tensor:
    """The eager expression: ``F.silu(gate) * up``, or ``act(gate) * up`` with the block's activation module `act`
    (its call as written: diffusers' ``FP32SiLU`` rounds through float32, which differs from ``F.silu`` in
    float64; an ``nn.SiLU(inplace=True)`` writes `gate`; hooks run); ``up * act(gate)`` with `up_first` (diffusers'
    ``SwiGLU``): the same values, but a product is laid out after its first operand where the two differ."""
    activated = F.silu(gate) if act is None else act(gate)
    return up * activated if up_first else activated * up


def act_reason(act: nn.Module | None) -> str | None:
    """Why the kernel cannot stand for ``act(x)``, hooks aside (the policy asks those), or ``None`` (``None``:
    ``F.silu`` itself)."""
    if act is None:
        return None
    if type(act) not in SILUS:
        return f"{type(act).__name__} is not nn.SiLU or FP32SiLU"
    if getattr(act, "inplace", False):
        return "SiLU in place"  # eager writes its input; the kernel does not
    return None


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The ``[B, L, D]`` rows the kernel runs on, as a view, and whether they are a feature map's channels-last rows
    (`_rows_layout`; the tensor as it is where that has none)."""
    rows = _rows_layout(t.shape, t.stride())
    if rows is None:
        return t, False
    return t.as_strided(rows[0], rows[1]), rows[2]


def _rows_layout(shape: tuple, strides: tuple) -> tuple[tuple, tuple, bool] | None:
    """The sizes and strides of the ``[B, L, D]`` rows the kernel runs on, for a tensor of `shape` and `strides`, and
    whether they are a feature map's channels-last rows; ``None`` where the tensor is taken as it is. Read from the
    sizes and strides alone: the guard asks this on every call, and the views it describes cost 2 us each to make
    (the kernel makes them, with one ``as_strided``; ``tests/test_silu_mul.py`` checks them against the views).

    Packed ``[N, D]`` rows are ``[1, N, D]`` (``unsqueeze(0)``). A feature map ``[B, C, *S]`` (Sana's ``GLUMBConv``
    halves) is ``[B, C, prod(S)]`` where its spatial dimensions collapse into one of unit stride (channels first), or
    ``[B, prod(S), C]`` where its channels have unit stride and its spatial dimensions collapse (channels last: the
    convolutions' output for a permuted ``[B, H, W, C]`` input; ``movedim(1, -1)`` then ``flatten``). Eager lays its
    result out in that same order (its elementwise kernels order dimensions by the inputs' strides), which is the
    order of the kernel's contiguous rows, as long as no dimension but the batch has size 1 (an ambiguous stride) and
    the batch is outermost: otherwise the tensor is taken as it is (and the guard refuses it for its shape)."""
    n = len(shape)
    if n == 2:
        return (1, shape[0], shape[1]), (shape[0] * strides[0], strides[0], strides[1]), False
    if n <= 3 or 1 in shape[1:] or strides[0] < max(st * k for st, k in zip(strides[1:], shape[1:])):
        return None
    last = strides[1] == 1
    if last:  # movedim(1, -1): the spatial dimensions 1 .. n - 2, channels innermost
        shape, strides = (shape[0], *shape[2:], shape[1]), (strides[0], *strides[2:], strides[1])
        lo, hi = 1, n - 2
    else:
        lo, hi = 2, n - 1
        if strides[hi] != 1:
            return None
    for i in range(lo, hi):
        if strides[i] != strides[i + 1] * shape[i + 1]:
            return None
    flat = 1
    for k in shape[lo:hi + 1]:
        flat *= k
    rows = (*shape[:lo], flat, *shape[hi + 1:])
    return rows, _view_strides(shape, strides, rows), last


def _view_strides(shape: tuple, strides: tuple, new: tuple) -> tuple:
    """The strides ``view(new)`` gives a tensor of `shape` and `strides` that it can view (aten's ``computeStride``,
    for a `new` that only merges dimensions: its size-1 dimensions get the stride of the chunk they sit in, not the
    merged dimension's own)."""
    out = [0] * len(new)
    if 0 in shape:  # (empty: aten's strides of a contiguous tensor, a size-0 dimension counted as 1)
        if tuple(shape) == tuple(new):
            return tuple(strides)
        step = 1
        for d in range(len(new) - 1, -1, -1):
            out[d] = step
            step *= max(new[d], 1)
        return tuple(out)
    view_d, base, numel, view_numel = len(new) - 1, strides[-1], 1, 1
    for d in range(len(shape) - 1, -1, -1):
        numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != numel * base):
            while view_d >= 0 and (view_numel < numel or new[view_d] == 1):
                out[view_d] = view_numel * base
                view_numel *= new[view_d]
                view_d -= 1
            if d > 0:
                base, numel, view_numel = strides[d - 1], 1, 1
    return tuple(out)


def _guard(gate: torch.Tensor, up: torch.Tensor, act: nn.Module | None = None, up_first: bool = False,
           check_pointers: bool = True, eager_layout: bool = False) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site).
    `eager_layout`: only where eager's product is laid out as the kernel's rows (`silu_mul`'s question; the raw op
    and `swiglu_cat`, whose concatenation is contiguous either way, take any row order)."""
    reason = act_reason(act)
    if reason is not None:
        return reason
    shape = gate.shape
    if shape != up.shape:  # (sizes equal: dims equal)
        return "shape"
    gate_strides, up_strides = gate.stride(), up.stride()
    if up_first and gate_strides != up_strides:
        return "operands laid out differently"  # the kernel lays its result out after gate, eager's after up
    # packed rows, feature maps: the kernel's [B, L, D] (`_rows_layout`, the views `_kernel` makes)
    rows = _rows_layout(shape, gate_strides)
    up_rows = rows if up_strides == gate_strides else _rows_layout(shape, up_strides)  # (a function of the two)
    sizes, strides, last = (tuple(shape), gate_strides, False) if rows is None else rows
    up_sizes, up_strides, up_last = (tuple(shape), up_strides, False) if up_rows is None else up_rows
    if last is not up_last:
        return "feature maps laid out differently"
    dtype = gate.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if up.dtype is not dtype:
        return "mixed dtypes"
    if len(sizes) != 3 or up_sizes != sizes:
        return "shape"
    vec = _VEC_BYTES // gate.element_size()
    if sizes[2] % vec:
        return f"D not a multiple of {vec}"
    if gate.numel() == 0:
        return "empty"
    if not (strides[2] == 1 and strides[1] % vec == 0 and strides[0] % vec == 0
            and up_strides[2] == 1 and up_strides[1] % vec == 0 and up_strides[0] % vec == 0):
        return "rows strided"
    if eager_layout and not layout_laid_out_contiguous(sizes, strides):
        return REASON_LAYOUT  # [B, L, D] rows in [L, B, D] memory: eager's product keeps that order, the kernel's not
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return "requires grad"
    if not gate.is_cuda:
        return f"device {gate.device.type}"
    if up.device != gate.device:
        return "devices differ"
    if check_pointers and (gate.data_ptr() % _VEC_BYTES or up.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


# The NVRTC way (ops/_nvrtc.py): csrc/silu_mul.cu's kernel, launched as its launch() and bindings.cpp's silu_mul(_out)
# do. Duplicated from there: kThreads 512, kRowsInFlight 1, kBlocksPerSm 16 (tests/test_nvrtc.py reads them from the
# .cu), the SiluMulArgs fields (fastpath.h) and the output allocation; the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("SiluMulArgs", ("out", "P"), ("gate", "P"), ("up", "P"), ("batch", "q"), ("seq", "q"),
                      ("dim", "q"), ("gate_stride_b", "q"), ("gate_stride_s", "q"), ("up_stride_b", "q"),
                      ("up_stride_s", "q"), ("out_stride_b", "q"), ("out_stride_s", "q"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel(
    "silu_mul.cu",
    "diffusers_fastpath::silu_mul_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("silu_mul_kernel", ("a", _ARGS), ("vecs_per_row", "i")),
)
_THREADS, _ROWS_IN_FLIGHT, _BLOCKS_PER_SM = 512, 1, 16


def nvrtc_launch(kernel: _nvrtc.Kernel, op: str, gate: torch.Tensor, up: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One of csrc/silu_mul.cu's kernels (`kernel`: this op's ``silu_mul_kernel``, `sigmoid_mul`'s
    ``sigmoid_mul_kernel``, one launch shape and argument list) on `gate`'s and `up`'s rows, into `out` or a new
    contiguous tensor."""
    batch, seq, dim = gate.shape
    if out is None:
        out = gate.new_empty(gate.shape)
    else:
        _nvrtc.check_out(op, out, gate.shape, gate, 16, rows=True)
    vecs, device = dim * gate.element_size() // _VEC_BYTES, gate.device.index
    grid, block = _nvrtc.row_grid(batch * seq, vecs, _THREADS, _ROWS_IN_FLIGHT, _nvrtc.num_sms(device), _BLOCKS_PER_SM)
    kernel.launch(device, gate.dtype, grid, block, out.data_ptr(), gate.data_ptr(), up.data_ptr(), batch, seq, dim,
                  gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), out.stride(0), out.stride(1),
                  _nvrtc.DTYPE_CODE[gate.dtype], vecs)
    return out


def _nvrtc_kernel(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return nvrtc_launch(_NVRTC, "silu_mul", gate, up, out)


_nvrtc.raw_op("_silu_mul_cuda", "(Tensor gate, Tensor up) -> Tensor", _guard, _nvrtc_kernel)
_nvrtc.raw_op("_silu_mul_cuda_out", "(Tensor(a!) out, Tensor gate, Tensor up) -> ()", _guard, _nvrtc_kernel, outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_silu_mul_cuda")


def _kernel(gate: torch.Tensor, up: torch.Tensor, launch=None) -> torch.Tensor:
    """The kernel on rows the guard took (`launch`: the raw op of csrc/silu_mul.cu's other kernel, `sigmoid_mul`'s;
    ``None``: this op's, read here, where the tests replace it)."""
    launch = _cuda_op if launch is None else launch
    if gate.dim() == 3:
        return launch(gate, up)
    # packed rows or a feature map (the guard took them): the kernel's [B, L, D], viewed back in eager's layout
    (rows, last), (up_rows, _) = _rows_of(gate), _rows_of(up)
    out = launch(rows, up_rows)
    return out.view(gate.shape[0], *gate.shape[2:], gate.shape[1]).movedim(-1, 1) if last else out.view(gate.shape)


def _new_out(gate: torch.Tensor) -> torch.Tensor:
    """An output for `gate`'s product laid out as `_kernel` lays it out (a channels-last feature map's channels last,
    else contiguous): what torch.compile is told (the fake) and what its op returns either way."""
    rows = _rows_layout(gate.shape, gate.stride()) if gate.dim() > 3 else None
    if rows is not None and rows[2]:
        return gate.new_empty(gate.shape[0], *gate.shape[2:], gate.shape[1]).movedim(-1, 1)
    return gate.new_empty(gate.shape)


def _nvrtc_kernel_out(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    _nvrtc_kernel(gate, up, out)


_kernel_out = LazyLauncher(_nvrtc_kernel_out, "_silu_mul_cuda_out")  # (out, gate, up): the product written into out


def _prove(gate: torch.Tensor, up: torch.Tensor, act=None, up_first=False) -> bool:
    """The kernel's SiLU equals eager's, bit for bit, on every value of the dtype (times one: exact); and so does
    the SiLU of the upcast value rounded back (diffusers' ``FP32SiLU``, Lumina's feed-forward activation), so the
    kernel stands for either."""
    values = every_value(gate.dtype, gate.device)
    ones = torch.ones_like(values)
    eager = bits(F.silu(values))
    return (torch.equal(bits(_kernel(values, ones)), eager)
            and torch.equal(bits(F.silu(values.float()).to(values.dtype)), eager))


@torch.library.custom_op("diffusers_fastpath::silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # What torch.compile runs: the kernel where the guard (with real pointers) allows, the eager expression elsewhere.
    # torch.compile emits this op only for dtypes already proven (see FusedOp).
    if _guard(gate, up) is None:
        return _kernel(gate, up)
    return _new_out(gate).copy_(silu_mul_ref(gate, up))


@_silu_mul_op.register_fake
def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    torch._check(gate.dim() >= 2 and up.shape == gate.shape,
                 lambda: "silu_mul: gate and up must be one [B, S, D] (or [N, D], or [B, C, *S])")
    return _new_out(gate)


def _signature(gate: torch.Tensor, up: torch.Tensor, act=None, up_first=False):
    return (str(gate.dtype).removeprefix("torch."),)  # the proof covers both activations: one check per dtype


def _op_guard(gate: torch.Tensor, up: torch.Tensor, act: nn.Module | None = None, up_first: bool = False,
              check_pointers: bool = True) -> str | None:
    """The fused op's guard: `_guard`, for rows whose eager product is contiguous as the kernel's."""
    return _guard(gate, up, act, up_first, check_pointers, eager_layout=True)


SILU_MUL = FusedOp(
    "silu_mul",
    ref=silu_mul_ref,
    guard=_op_guard,
    kernel=lambda gate, up, act=None, up_first=False: _kernel(gate, up),
    custom_op=lambda gate, up, act=None, up_first=False: torch.ops.diffusers_fastpath.silu_mul.default(gate, up),
    verify_key=_signature,
    prove=_prove,
    modules=(2,),  # the activation module whose call the kernel stands for: its hooks refuse the call
)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, site: Site | None = None,
             act: nn.Module | None = None, up_first: bool = False) -> torch.Tensor:
    """``F.silu(gate) * up`` (or ``act(gate) * up``), fused on CUDA and bit-identical to eager everywhere (the SiLU
    proven on every value of the dtype on first use).

    Args:
        gate: ``[B, L, D]`` (or packed ``[N, D]``) input of the SiLU (e.g. the first ``chunk(2, dim=-1)`` half of
            the FFN's projection).
        up: the other factor, of gate's dtype and shape.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        act: the activation module the expression calls (``nn.SiLU`` or diffusers' ``FP32SiLU``), or ``None`` for
            ``F.silu``: wherever the kernel does not run, ``act(gate) * up`` runs as written (its hooks too).
        up_first: the expression is ``up * act(gate)`` (diffusers' ``SwiGLU``): what runs where the kernel does not,
            and the kernel only where both operands are laid out alike (so that its result is laid out as eager's).

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import silu_mul, silu_mul_ref
        >>> gate, up = torch.randn(1, 16, 128).chunk(2, dim=-1)
        >>> torch.equal(silu_mul(gate, up), silu_mul_ref(gate, up))
        True
    """
    return SILU_MUL(site, gate, up, act, up_first)


# --- FLUX.2's parallel single blocks: the SwiGLU written into the concatenation after it ------------------------


def swiglu_cat_ref(attn: torch.Tensor, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
    """The eager expression: ``torch.cat([attn, F.silu(x[..., :h]) * x[..., h:]], dim=-1)``, ``h = x.shape[-1] // 2``
    (``Flux2SwiGLU`` on the MLP half of the fused projection, then the concatenation before ``to_out``), with the
    SwiGLU's gate module `act` called as written where given (`silu_mul_ref`)."""
    half = x.shape[-1] // 2
    return torch.cat([attn, silu_mul_ref(x[..., :half], x[..., half:], act)], dim=-1)


def _cat_guard(attn: torch.Tensor, x: torch.Tensor, act: nn.Module | None = None,
               check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs: `x`'s halves as `silu_mul` takes them, `attn` of their dtype,
    batch and length with whole 16-byte vectors per row (so the SwiGLU columns start aligned in every output row)."""
    if not isinstance(attn, torch.Tensor) or attn.dim() != 3 or x.dim() != 3 or attn.shape[:2] != x.shape[:2]:
        return "shape"
    if x.shape[2] % 2:
        return "odd width"
    if attn.dtype is not x.dtype:
        return "mixed dtypes"
    if attn.dtype in HALF_DTYPES and attn.shape[2] % (_VEC_BYTES // attn.element_size()):
        return f"attention width not a multiple of {_VEC_BYTES // attn.element_size()}"
    half = x.shape[2] // 2
    reason = _guard(x[..., :half], x[..., half:], act, check_pointers=check_pointers)
    if reason is not None:
        return reason
    if torch.is_grad_enabled() and attn.requires_grad:
        return "requires grad"
    if attn.device != x.device:
        return "devices differ"
    return None


def _cat_kernel(attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    batch, seq, width = attn.shape
    half = x.shape[2] // 2
    out = attn.new_empty(batch, seq, width + half)
    out[..., :width].copy_(attn)  # the concatenation's copy of the first operand (exact)
    _kernel_out(out[..., width:], x[..., :half], x[..., half:])
    return out


@torch.library.custom_op("diffusers_fastpath::swiglu_cat", mutates_args=())
def _swiglu_cat_op(attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if _cat_guard(attn, x) is None:
        return _cat_kernel(attn, x)
    return swiglu_cat_ref(attn, x).contiguous()


@_swiglu_cat_op.register_fake
def _swiglu_cat_fake(attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    torch._check(attn.dim() == 3 and x.dim() == 3, lambda: "swiglu_cat: attn and x must be [B, S, D]")
    return attn.new_empty(attn.shape[0], attn.shape[1], attn.shape[2] + x.shape[2] // 2)


def _cat_signature(attn: torch.Tensor, x: torch.Tensor, act=None):
    return (str(x.dtype).removeprefix("torch."),)


def _cat_prove(attn: torch.Tensor, x: torch.Tensor, act=None) -> bool:
    return _prove(x, x)  # the SiLU on every value of the dtype, as silu_mul proves it


SWIGLU_CAT = FusedOp(
    "swiglu_cat",
    ref=swiglu_cat_ref,
    guard=_cat_guard,
    kernel=lambda attn, x, act=None: _cat_kernel(attn, x),
    custom_op=lambda attn, x, act=None: torch.ops.diffusers_fastpath.swiglu_cat.default(attn, x),
    verify_key=_cat_signature,
    prove=_cat_prove,
    modules=(2,),  # the gate's SiLU module, whose call the kernel stands for: its hooks refuse the call
)


def swiglu_cat(attn: torch.Tensor, x: torch.Tensor, site: Site | None = None,
               act: nn.Module | None = None) -> torch.Tensor:
    """``torch.cat([attn, F.silu(x[..., :h]) * x[..., h:]], dim=-1)`` with ``h = x.shape[-1] // 2``, fused on CUDA
    (the SwiGLU written into its columns of the result) and bit-identical to eager everywhere.

    Args:
        attn: ``[B, L, Da]`` the attention output (any layout: it is copied).
        x: ``[B, L, 2H]`` the MLP half of the projection (e.g. the second ``torch.split`` part of FLUX.2's
            ``to_qkv_mlp_proj`` output: a strided view, taken without a copy).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        act: the SwiGLU's gate module (``nn.SiLU`` or ``FP32SiLU``) the expression calls, or ``None`` for
            ``F.silu``: wherever the kernel does not run, it runs as written.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import swiglu_cat, swiglu_cat_ref
        >>> attn, x = torch.randn(1, 16, 64), torch.randn(1, 16, 256)
        >>> torch.equal(swiglu_cat(attn, x), swiglu_cat_ref(attn, x))
        True
    """
    return SWIGLU_CAT(site, attn, x, act)
