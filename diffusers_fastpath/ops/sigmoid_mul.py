"""A sigmoid output gate, ``x * torch.sigmoid(gate)``, in one pass (Krea 2's attention processor: the attention output
``[B, S, H * D]`` after ``flatten(2, 3)`` times the sigmoid of ``attn.to_gate(hidden_states)``, before ``to_out``).

Formula and rounding points (T = fp16 or bf16, fp32 arithmetic, ``round`` to nearest even in T), those of the two
eager kernels it replaces::

    out = round(x * round(1 / (1 + exp(-gate))))

The sigmoid is aten's ``sigmoid_kernel_cuda`` expression (``aten/src/ATen/native/cuda/UnarySpecialOpsKernel.cu``,
the real types: ``one / (one + std::exp(-opmath_t{a}))`` in fp32 opmath) with CUDA's ``expf``; it is a function of
one 16-bit value, so on its first call per dtype the op runs all 65536 bit patterns through the kernel and through
eager ``torch.sigmoid`` and compares the bits (as `silu_mul` proves its SiLU): equal, or the op disables itself for
the process with one warning and runs the eager expression. The multiply is exact by construction (one fp32 product,
one rounding: a product of two numbers commutes exactly, so the kernel's ``s * x`` is eager's ``x * s``). The kernel
is ``csrc/silu_mul.cu``'s ``sigmoid_mul_kernel``, `silu_mul`'s body with the other activation; it reads each input
once and writes once (eager: the sigmoid reads and writes, the multiply reads two and writes; Krea 2 at 1024x1024 on
an H100: 1.14 + 1.68 ms a step in 32 ``sigmoid_kernel_cuda`` and 32 multiply kernels).

What the guard takes is what `silu_mul` takes for its ``up * act(gate)`` form (`silu_mul._guard`, ``up_first``), here
``up = x``: fp16/bf16 CUDA ``[B, L, D]`` of one shape and dtype with unit innermost stride and 16-byte aligned rows
(packed ``[N, D]`` rows and channel-split feature maps as `silu_mul` takes them), ``x`` and ``gate`` laid out alike
(eager lays the product out after ``x``, the kernel after ``gate``: equal strides make the two one) and in rows whose
eager product is contiguous as the kernel's (`_policy.laid_out_contiguous`); no autograd. Krea 2's operands qualify
without a copy: ``to_gate``'s output is contiguous, and so is the attention output after ``flatten(2, 3)`` with
diffusers' native backend, with its repeated heads or through `attention_gqa` (its ``[B, S, H, D]`` result is a
``permute`` back of torch's SDPA output, which flash, efficient and cuDNN attention allocate in q's layout, token-major,
so the flatten is a view; the math backend's head-major result is copied contiguous by the flatten), and so would be
`attention_seq_major`'s output read back as ``[B, S, H * D]`` (token-major memory: SD3's reshape is a view of it).
Anything else (a transposed ``x``, operands laid out differently, fp32) runs the eager expression.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site, bits
from .gelu_cat import every_value
from .silu_mul import _ARGS, _guard, _kernel, _new_out, nvrtc_launch


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The eager expression: ``x * torch.sigmoid(gate)`` (laid out after `x`, its first operand)."""
    return x * torch.sigmoid(gate)


# The NVRTC way (ops/_nvrtc.py): csrc/silu_mul.cu's sigmoid_mul_kernel, launched as silu_mul_kernel is (one launch
# shape, one SiluMulArgs: `silu_mul.nvrtc_launch`), `gate` the sigmoid's input and `up` the other factor.
_NVRTC = _nvrtc.Kernel(
    "silu_mul.cu",
    "diffusers_fastpath::sigmoid_mul_kernel",
    {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
    _nvrtc.Params("sigmoid_mul_kernel", ("a", _ARGS), ("vecs_per_row", "i")),
)


def _nvrtc_kernel(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return nvrtc_launch(_NVRTC, "sigmoid_mul", gate, up, out)


_nvrtc.raw_op("_sigmoid_mul_cuda", "(Tensor gate, Tensor up) -> Tensor", _guard, _nvrtc_kernel)
_nvrtc.raw_op("_sigmoid_mul_cuda_out", "(Tensor(a!) out, Tensor gate, Tensor up) -> ()", _guard, _nvrtc_kernel,
              outs=1)

_cuda_op = LazyLauncher(_nvrtc_kernel, "_sigmoid_mul_cuda")


def _fused(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The kernel on the rows the guard took (`silu_mul._kernel`'s views: packed rows, feature maps), with this
    module's launcher, read here (the tests replace it)."""
    return _kernel(gate, x, _cuda_op)


def _op_guard(x: torch.Tensor, gate: torch.Tensor, check_pointers: bool = True) -> str | None:
    """`silu_mul`'s guard of ``up * act(gate)`` (``up = x``): operands laid out alike, rows whose eager product is
    contiguous as the kernel's."""
    return _guard(gate, x, None, True, check_pointers, eager_layout=True)


def _prove(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """The kernel's sigmoid equals eager's, bit for bit, on every value of the dtype (each times one: exact)."""
    values = every_value(gate.dtype, gate.device)
    ones = torch.ones_like(values)
    return torch.equal(bits(_fused(ones, values)), bits(sigmoid_mul_ref(ones, values)))


@torch.library.custom_op("diffusers_fastpath::sigmoid_mul", mutates_args=())
def _sigmoid_mul_op(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # What torch.compile runs: the kernel where the guard (with real pointers) allows, the eager expression elsewhere.
    # torch.compile emits this op only for dtypes already proven (see FusedOp).
    if _op_guard(x, gate) is None:
        return _fused(x, gate)
    return _new_out(x).copy_(sigmoid_mul_ref(x, gate))


@_sigmoid_mul_op.register_fake
def _sigmoid_mul_fake(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() >= 2 and gate.shape == x.shape,
                 lambda: "sigmoid_mul: x and gate must be one [B, S, D] (or [N, D], or [B, C, *S])")
    return _new_out(x)


def _signature(x: torch.Tensor, gate: torch.Tensor):
    return (str(gate.dtype).removeprefix("torch."),)  # a function of one value: one proof per dtype


SIGMOID_MUL = FusedOp(
    "sigmoid_mul",
    ref=sigmoid_mul_ref,
    guard=_op_guard,
    kernel=_fused,
    custom_op=lambda x, gate: torch.ops.diffusers_fastpath.sigmoid_mul.default(x, gate),
    verify_key=_signature,
    prove=_prove,
)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``x * torch.sigmoid(gate)``, fused on CUDA and bit-identical to eager everywhere (the sigmoid proven on every
    value of the dtype on first use).

    Args:
        x: ``[B, L, D]`` (or packed ``[N, D]``) the gated tensor (Krea 2: the attention output, ``flatten(2, 3)``).
        gate: the sigmoid's input, of x's dtype, shape and strides (Krea 2: ``attn.to_gate(hidden_states)``).
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import sigmoid_mul, sigmoid_mul_ref
        >>> x, gate = torch.randn(1, 16, 64), torch.randn(1, 16, 64)
        >>> torch.equal(sigmoid_mul(x, gate), sigmoid_mul_ref(x, gate))
        True
    """
    return SIGMOID_MUL(site, x, gate)
