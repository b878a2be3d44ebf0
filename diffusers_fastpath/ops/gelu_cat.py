"""FLUX.1's single-block concatenation of the attention output and the tanh-GELU of the MLP, in one pass.

Eager (``FluxSingleTransformerBlock``; ``act_mlp`` is ``torch.nn.GELU(approximate="tanh")``)::

    mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    ...
    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)

runs the GELU (a read and a write of the MLP activations, 4 x hidden wide) and then the ``cat`` (a read and a
write of everything again). The kernel (``csrc/gelu_cat.cu``) reads ``attn`` and the GELU's input once and writes
the concatenation once, with aten's GELU expression (rounded once to the storage dtype, as aten does).

GELU is a function of one fp16/bf16 value, so its exactness can be proven, not sampled: the first fast call of each
dtype also runs the kernel on all 65536 bit patterns of that dtype and compares the bits with eager ``F.gelu``
(NaNs included). A mismatch (another aten build, another ``tanhf``) disables the op for the process with one
warning; its calls then run the eager GELU and ``cat``. The copy of ``attn`` is exact by construction.

The guard admits fp16/bf16 CUDA tensors ``[B, S, D]`` of one batch and length, dims that are multiples of 16 bytes,
rows with unit innermost stride and 16-byte aligned starts (``attn`` may be a strided view, as SDPA's output after
``flatten(2, 3)``), no autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site, bits

_VEC_BYTES = 16


def gelu_cat_ref(attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=2)``."""
    return torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=2)


def _rows_ok(t: torch.Tensor, vec: int) -> bool:
    return t.stride(2) == 1 and t.stride(1) % vec == 0 and t.stride(0) % vec == 0


def _guard(attn: torch.Tensor, mlp: torch.Tensor, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the call site)."""
    dtype = attn.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if mlp.dtype is not dtype:
        return "mixed dtypes"
    if attn.dim() != 3 or mlp.dim() != 3 or attn.shape[:2] != mlp.shape[:2]:
        return "shape"
    vec = _VEC_BYTES // attn.element_size()
    if attn.shape[2] % vec or mlp.shape[2] % vec:
        return f"D not a multiple of {vec}"
    if attn.numel() == 0 or mlp.numel() == 0:
        return "empty"
    if not (_rows_ok(attn, vec) and _rows_ok(mlp, vec)):
        return "rows strided"
    if torch.is_grad_enabled() and (attn.requires_grad or mlp.requires_grad):
        return "requires grad"
    if not attn.is_cuda:
        return f"device {attn.device.type}"
    if mlp.device != attn.device:
        return "devices differ"
    if check_pointers and (attn.data_ptr() % _VEC_BYTES or mlp.data_ptr() % _VEC_BYTES):
        return "not 16-byte aligned"
    return None


# The NVRTC way (ops/_nvrtc.py): csrc/gelu_cat.cu's kernel, launched as its launch() and bindings.cpp's gelu_cat(_out)
# do. Duplicated from there: kThreads 512, kRowsInFlight 1, kBlocksPerSm 16 (tests/test_nvrtc.py reads them from the
# .cu), the GeluCatArgs fields (fastpath.h), the flat-rows variant and the output allocation; the guard stands for
# bindings.cpp's input checks.
_ARGS = _nvrtc.Params("GeluCatArgs", ("out", "P"), ("attn", "P"), ("mlp", "P"), ("batch", "q"), ("seq", "q"),
                      ("attn_dim", "q"), ("mlp_dim", "q"), ("attn_stride_b", "q"), ("attn_stride_s", "q"),
                      ("mlp_stride_b", "q"), ("mlp_stride_s", "q"), ("dtype", "i"))
_NVRTC = _nvrtc.Kernel(
    "gelu_cat.cu",
    "diffusers_fastpath::gelu_cat_kernel",
    {(dtype, flat): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(flat).lower()}" for dtype in HALF_DTYPES for flat in (True, False)},
    _nvrtc.Params("gelu_cat_kernel", ("a", _ARGS), ("attn_vecs", "i"), ("vecs_per_row", "i")),
)
_THREADS, _ROWS_IN_FLIGHT, _BLOCKS_PER_SM = 512, 1, 16


def _nvrtc_kernel(attn: torch.Tensor, mlp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    batch, seq, attn_dim = attn.shape
    mlp_dim = mlp.shape[2]
    if out is None:
        out = attn.new_empty((batch, seq, attn_dim + mlp_dim))
    else:
        _nvrtc.check_out("gelu_cat", out, (batch, seq, attn_dim + mlp_dim), attn, 16)
    vec = _VEC_BYTES // attn.element_size()
    attn_vecs, vecs, device = attn_dim // vec, (attn_dim + mlp_dim) // vec, attn.device.index
    asb, ass, msb, mss = attn.stride(0), attn.stride(1), mlp.stride(0), mlp.stride(1)
    flat = batch == 1 or (asb == seq * ass and msb == seq * mss)
    grid, block = _nvrtc.row_grid(batch * seq, vecs, _THREADS, _ROWS_IN_FLIGHT, _nvrtc.num_sms(device), _BLOCKS_PER_SM)
    _NVRTC.launch(device, (attn.dtype, flat), grid, block, out.data_ptr(), attn.data_ptr(), mlp.data_ptr(), batch, seq,
                  attn_dim, mlp_dim, asb, ass, msb, mss, _nvrtc.DTYPE_CODE[attn.dtype], attn_vecs, vecs)
    return out


_nvrtc.raw_op("_gelu_cat_cuda", "(Tensor attn, Tensor mlp) -> Tensor", _guard, _nvrtc_kernel)
_nvrtc.raw_op("_gelu_cat_cuda_out", "(Tensor(a!) out, Tensor attn, Tensor mlp) -> ()", _guard, _nvrtc_kernel, outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_gelu_cat_cuda")


def _kernel(attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return _cuda_op(attn, mlp)


def every_value(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """All 65536 fp16/bf16 bit patterns (NaNs and infinities included) as one ``[1, 8, 8192]`` tensor."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(dtype).view(1, 8, 8192)


def _prove(attn: torch.Tensor, mlp: torch.Tensor) -> bool:
    """The kernel's GELU equals eager's, bit for bit, on every value of the dtype (and the copy on some)."""
    values = every_value(mlp.dtype, mlp.device)
    ref = gelu_cat_ref(values[:, :, :64], values)
    out = _kernel(values[:, :, :64], values)
    return torch.equal(bits(out), bits(ref))


@torch.library.custom_op("diffusers_fastpath::gelu_cat", mutates_args=())
def _gelu_cat_op(attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    # The real implementation behind torch.compile: the kernel where the guard (now with real pointers) allows,
    # the eager expression elsewhere. torch.compile emits this op only for dtypes already proven (see FusedOp).
    if _guard(attn, mlp) is None:
        return _kernel(attn, mlp)
    return gelu_cat_ref(attn, mlp)


@_gelu_cat_op.register_fake
def _gelu_cat_fake(attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    torch._check(attn.dim() == 3 and mlp.dim() == 3, lambda: "gelu_cat: attn and mlp must be [B, S, D]")
    return attn.new_empty((attn.shape[0], attn.shape[1], attn.shape[2] + mlp.shape[2]))


def _signature(attn: torch.Tensor, mlp: torch.Tensor):
    return (str(mlp.dtype).removeprefix("torch."),)


GELU_CAT = FusedOp(
    "gelu_cat",
    ref=gelu_cat_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=torch.ops.diffusers_fastpath.gelu_cat.default,
    verify_key=_signature,
    prove=_prove,
)


def gelu_cat(attn: torch.Tensor, mlp: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=2)``, fused on CUDA and bit-identical to eager.

    Args:
        attn: ``[B, S, Da]`` attention output (rows may be strided).
        mlp: ``[B, S, Dm]`` the MLP's up-projection, before its tanh-GELU.
        site: the call site's counters (fast calls, fallbacks with reasons), shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import gelu_cat, gelu_cat_ref
        >>> attn, mlp = torch.randn(1, 4, 16), torch.randn(1, 4, 64)
        >>> torch.equal(gelu_cat(attn, mlp), gelu_cat_ref(attn, mlp))
        True
    """
    return GELU_CAT(site, attn, mlp)
