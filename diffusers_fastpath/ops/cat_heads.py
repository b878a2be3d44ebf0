"""``torch.cat([a, b], dim=2)`` of two ``[B, H, S, D]`` operands (SD3's joint attention: image and text q, k, v), in
one vectorised copy.

Eager (``JointAttnProcessor2_0``)::

    query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)      # and its QK norm
    ...
    query = torch.cat([query, encoder_hidden_states_query_proj], dim=2)          # likewise key and value

Each operand is a ``[B, H, S, D]`` view of a ``[B, S, H, D]`` projection, so aten's ``CatArrayBatchedCopy`` reads
them element by element (it vectorises contiguous inputs only): 64 µs a call at SD3.5-large's 1024x1024 shapes on
the H200, 7.3 ms of a 76 ms step for its 114 calls (`docs/results/bench_sd3.5-large_1024_profile_efcc678.md`). The
kernel (``csrc/cat_heads.cu``) moves 16-byte vectors of each row instead and writes the same contiguous
``[B, H, Sa + Sb, D]`` tensor.

A copy is exact by construction (no value is computed); what a copy can get wrong is where it reads, so the first
fast call of each signature (dtype, row length, operand layouts) is also compared with ``torch.cat`` by
``torch.equal``, and a mismatch disables the op for the process with one warning, as for the self-verified ops.

The guard admits fp16/bf16 CUDA tensors of one batch, head count, row length and dtype, rows of whole 16-byte
vectors with unit innermost stride and 16-byte aligned starts, at least two heads (so that no operand can look
channels-last to ``torch.cat``, whose result is then contiguous, as the kernel's), no autograd.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site

_VEC_BYTES = 16


def cat_heads_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``torch.cat([a, b], dim=2)``."""
    return torch.cat([a, b], dim=2)


def _rows_ok(t: torch.Tensor, vec: int) -> bool:
    return t.stride(3) == 1 and all(t.stride(d) % vec == 0 for d in range(3))


def _guard(a: torch.Tensor, b: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    dtype = a.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if b.dtype is not dtype:
        return "mixed dtypes"
    if a.dim() != 4 or b.dim() != 4 or a.shape[:2] != b.shape[:2] or a.shape[3] != b.shape[3]:
        return "shape"
    vec = _VEC_BYTES // a.element_size()
    if a.shape[3] % vec:
        return f"D not a multiple of {vec}"
    if a.numel() == 0 or b.numel() == 0:
        return "empty"
    if not (_rows_ok(a, vec) and _rows_ok(b, vec)):
        return "rows strided"
    if a.shape[1] < 2:  # one head: a layout torch.cat may take as channels-last (and keep); the kernel writes contiguous
        return "one head"
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return "requires grad"
    if not a.is_cuda:
        return f"device {a.device.type}"
    if b.device != a.device:
        return "devices differ"
    if check_pointers and (a.data_ptr() % _VEC_BYTES or b.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


# The NVRTC way (ops/_nvrtc.py): csrc/cat_heads.cu's kernel, launched as its launch() and bindings.cpp's cat_heads
# do. Duplicated from there: kThreads 256, kRowsInFlight 4, kBlocksPerSm 8 (tests/test_nvrtc.py reads them from the
# .cu), the CatHeadsArgs fields (fastpath.h) and the output allocation; the guard stands for bindings.cpp's checks.
_ARGS = _nvrtc.Params("CatHeadsArgs", ("out", "P"), ("a", "P"), ("b", "P"), ("batch", "q"), ("heads", "q"),
                      ("seq_a", "q"), ("seq_b", "q"), ("dim", "q"), ("a_stride_b", "q"), ("a_stride_h", "q"),
                      ("a_stride_s", "q"), ("b_stride_b", "q"), ("b_stride_h", "q"), ("b_stride_s", "q"),
                      ("dtype", "i"))
_NVRTC = _nvrtc.Kernel(
    "cat_heads.cu",
    "diffusers_fastpath::cat_heads_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("cat_heads_kernel", ("a", _ARGS), ("vecs_per_row", "i")),
)
_THREADS, _ROWS_IN_FLIGHT, _BLOCKS_PER_SM = 256, 4, 8


def _nvrtc_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, heads, seq_a, dim = a.shape
    seq_b = b.shape[2]
    out = a.new_empty((batch, heads, seq_a + seq_b, dim))
    if out.numel() == 0:
        return out
    vecs, device = dim * a.element_size() // _VEC_BYTES, a.device.index
    grid, block = _nvrtc.row_grid(batch * heads * (seq_a + seq_b), vecs, _THREADS, _ROWS_IN_FLIGHT,
                                  _nvrtc.num_sms(device), _BLOCKS_PER_SM)
    _NVRTC.launch(device, a.dtype, grid, block, out.data_ptr(), a.data_ptr(), b.data_ptr(), batch, heads, seq_a,
                  seq_b, dim, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
                  _nvrtc.DTYPE_CODE[a.dtype], vecs)
    return out


_nvrtc.raw_op("_cat_heads_cuda", "(Tensor a, Tensor b) -> Tensor", _guard, _nvrtc_kernel)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_cat_heads_cuda")


def _kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _cuda_op(a, b)


@torch.library.custom_op("diffusers_fastpath::cat_heads", mutates_args=())
def _cat_heads_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # What torch.compile runs: the kernel where the guard (with real pointers) allows, the eager expression elsewhere
    # (made contiguous: the op's fake promises a contiguous result; torch.cat gives one for every layout the guard
    # admits, and `.contiguous()` is then free).
    if _guard(a, b) is None:
        return _kernel(a, b)
    return cat_heads_ref(a, b).contiguous()


@_cat_heads_op.register_fake
def _cat_heads_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    torch._check(a.dim() == 4 and b.dim() == 4, lambda: "cat_heads: a and b must be [B, H, S, D]")
    return a.new_empty((a.shape[0], a.shape[1], a.shape[2] + b.shape[2], a.shape[3]))


def _signature(a: torch.Tensor, b: torch.Tensor):
    # a copy's rounding cannot differ; its addressing can: one check per dtype, row length and pair of layouts
    return (str(a.dtype).removeprefix("torch."), a.shape[3], a.stride(), b.stride())


CAT_HEADS = FusedOp(
    "cat_heads",
    ref=cat_heads_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=torch.ops.diffusers_fastpath.cat_heads.default,
    verify_key=_signature,
)


def cat_heads(a: torch.Tensor, b: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``torch.cat([a, b], dim=2)`` of two ``[B, H, S, D]`` tensors, one vectorised copy on CUDA, bit-identical to
    eager (and contiguous, as eager's is).

    Args:
        a: ``[B, H, Sa, D]``, any layout whose ``D``-rows have unit stride (SD3's ``[B, H, S, D]`` views of
            ``[B, S, H, D]`` projections).
        b: ``[B, H, Sb, D]``, likewise.
        site: the call site's counters (fast calls, fallbacks with reasons), shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import cat_heads, cat_heads_ref
        >>> a, b = torch.randn(1, 8, 2, 64).transpose(1, 2), torch.randn(1, 3, 2, 64).transpose(1, 2)
        >>> torch.equal(cat_heads(a, b), cat_heads_ref(a, b))
        True
    """
    return CAT_HEADS(site, a, b)
