"""An FFN up-projection and its tanh-GELU in one cuBLASLt call (the "high" tier, not bit-exact).

Eager (diffusers' ``GELU(approximate="tanh")`` module, FLUX's single-block ``act_mlp(proj_mlp(x))``) runs the GEMM
with its bias, writes the ``[rows, 4 * D]`` pre-activation, reads it back and runs the GELU::

    ref = F.gelu(F.linear(x, weight, bias), approximate="tanh")

Here the GELU is the GEMM's epilogue: ``torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)``, which on
CUDA asks cuBLASLt for ``CUBLASLT_EPILOGUE_GELU_BIAS`` (aten ``Blas.cpp``; where cuBLASLt cannot take the shapes,
aten itself runs the GEMM and then ``gelu_(approximate="tanh")``). The pre-activation never reaches memory: at
FLUX.1-dev shapes that is one write and one read of a (4096..4608, 12288) bf16 tensor less per site, 57 sites a step.

Rounding (T = bf16 or fp16, unit roundoff u = 2^-8 resp. 2^-11): eager rounds the fp32 accumulator plus bias to T,
then computes the GELU in fp32 from that and rounds again; the epilogue applies the GELU to the fp32 value and
rounds once, and cuBLASLt may pick another GEMM algorithm (another accumulation order). With ``|GELU'| <= 1.13``
the difference is at most about ``(1.13 |p| + 2 |GELU(p)|) u`` (``p`` the pre-activation), which is within
``rtol = 4u`` plus a small ``atol`` for the negative tail where GELU is near 0 and ``|p * GELU'(p)| <= 0.2``. The
contract, asserted on the GPU at (4096, 3072) -> 12288 (``tests/test_quality_gpu.py``)::

    bf16: assert_close(out, ref, rtol=2**-6, atol=2**-7)
    fp16: assert_close(out, ref, rtol=2**-9, atol=2**-10)

Guard, per call: CUDA, bf16/fp16 for ``x``, ``weight`` and ``bias`` alike, a bias (the epilogue adds it), shapes
that match, no autograd. Other calls run ``ref``, exactly as eager, counted with their reason. On the CPU torch's
``_addmm_activation(use_gelu=True)`` computes the exact (erf) GELU, not the tanh one
(``tests/test_linear_gelu.py::test_cpu_addmm_activation_is_the_erf_gelu``), so the op is CUDA-only by its guard and
its custom op runs ``ref`` off CUDA.

Which modules qualify (a plain ``nn.Linear`` with a floating-point weight and a bias, no hooks; not a quantized or
LoRA-wrapped layer) is decided when the site is mounted, by `diffusers_fastpath.quality`.
``torch.compile`` sees the registered custom op ``diffusers_fastpath::linear_gelu`` (with a fake).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._policy import HALF_DTYPES, FusedOp, Site

_DEVICE_TYPES = ("cuda",)  # where cuBLASLt's epilogue exists; elsewhere the eager path runs

# The contract against eager (``linear_gelu_ref``), per dtype: (rtol, atol) for ``torch.testing.assert_close``.
TOLERANCES = {torch.bfloat16: (2**-6, 2**-7), torch.float16: (2**-9, 2**-10)}


def linear_gelu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Eager: the up-projection, then the tanh-GELU (two kernels, the pre-activation rounded in between)."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The fused call (CUDA): one cuBLASLt GEMM with the bias + tanh-GELU epilogue, on ``x`` flattened to 2-D."""
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


def _guard(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, check_pointers: bool = True) -> str | None:
    """``None`` when the epilogue takes this call, else why not (the call then runs eager)."""
    if bias is None:
        return "no bias"
    dtype = x.dtype
    if dtype not in HALF_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if weight.dtype is not dtype or bias.dtype is not dtype:
        return "mixed dtypes"
    if x.dim() < 2 or weight.dim() != 2 or bias.dim() != 1:
        return "shape"
    if x.shape[-1] != weight.shape[1] or bias.shape[0] != weight.shape[0]:
        return "shape"
    if x.numel() == 0 or weight.numel() == 0:
        return "empty"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return "requires grad"
    if x.device.type not in _DEVICE_TYPES:
        return f"device {x.device.type}"
    if weight.device != x.device or bias.device != x.device:
        return "devices differ"
    return None


@torch.library.custom_op("diffusers_fastpath::linear_gelu", mutates_args=())
def _linear_gelu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return linear_gelu_epilogue(x, weight, bias)
    return linear_gelu_ref(x, weight, bias).contiguous()  # CPU's _addmm_activation is the erf GELU


@_linear_gelu_op.register_fake
def _linear_gelu_fake(x, weight, bias):
    torch._check(x.dim() >= 2 and weight.dim() == 2, lambda: "linear_gelu: x must be [..., K], weight [N, K]")
    torch._check(x.shape[-1] == weight.shape[1], lambda: "linear_gelu: x and weight disagree on K")
    torch._check(bias.dim() == 1 and bias.shape[0] == weight.shape[0], lambda: "linear_gelu: bias must be [N]")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


LINEAR_GELU = FusedOp(
    "linear_gelu",
    ref=linear_gelu_ref,
    guard=_guard,
    kernel=linear_gelu_epilogue,
    custom_op=torch.ops.diffusers_fastpath.linear_gelu.default,
)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias), approximate="tanh")`` as one cuBLASLt call with a GELU epilogue ("high").

    Close to eager, not bit-identical: within `TOLERANCES` (bf16 rtol 2^-6, atol 2^-7; fp16 rtol 2^-9, atol 2^-10).
    Calls the guard rejects (CPU, fp32, autograd) run eager exactly.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]`` weight of a plain ``nn.Linear``.
        bias: ``[N]`` bias.
        site: the call site's counters (calls on the fused path, fallbacks with reasons), shown by `report`.

    Example:
        >>> import torch
        >>> from diffusers_fastpath.ops import linear_gelu, linear_gelu_ref
        >>> x, w, b = torch.randn(1, 16, 64), torch.randn(256, 64), torch.randn(256)
        >>> torch.equal(linear_gelu(x, w, b), linear_gelu_ref(x, w, b))  # CPU: the eager path
        True
    """
    return LINEAR_GELU(site, x, weight, bias)
