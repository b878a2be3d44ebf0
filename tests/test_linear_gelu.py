"""linear_gelu ("high"): the cuBLASLt GELU epilogue against eager, its guards, the custom op."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from diffusers_fastpath.ops import Site, linear_gelu, linear_gelu_ref

LG = sys.modules["diffusers_fastpath.ops.linear_gelu"]  # the module (the package exports the function)
DTYPES = [torch.bfloat16, torch.float16]


def make_inputs(rows, k, n, dtype, device, seed, batch=1):
    """An FFN input (LayerNorm-modulated activations are O(1)) and an nn.Linear-like weight N(0, 1/K) and bias."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, rows, k, generator=gen, device=device).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    bias = (torch.randn(n, generator=gen, device=device) * 0.5).to(dtype)
    return x, weight, bias


# --- GPU: the contract -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,rows", [(1, 4096), (1, 4608), (1, 512), (2, 1024), (1, 17)], ids=str)
def test_epilogue_is_close_to_eager_at_flux_shapes(batch, rows, dtype):
    rtol, atol = LG.TOLERANCES[dtype]
    for seed in range(2):  # fresh inputs each round
        x, weight, bias = make_inputs(rows, 3072, 12288, dtype, "cuda", seed, batch)
        ref = linear_gelu_ref(x, weight, bias)
        site = Site("linear_gelu")
        out = linear_gelu(x, weight, bias, site)
        assert site.fast == 1 and not site.fallback, site
        assert out.shape == ref.shape and out.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_runs_no_separate_gelu_kernel(dtype):
    """The point of the op: the GELU is the GEMM's epilogue, so no elementwise GELU kernel is launched (eager
    launches one). Fails if aten sends the call to its non-cuBLASLt path (GEMM, then gelu_)."""
    from torch.profiler import ProfilerActivity, profile

    x, weight, bias = make_inputs(4096, 3072, 12288, dtype, "cuda", 1)

    def kernels(fn):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type.name == "CUDA"]

    aten_gelu = lambda names: [k for k in names if "GeluCUDAKernelImpl" in k]  # noqa: E731  (aten's elementwise GELU)
    eager = kernels(lambda: linear_gelu_ref(x, weight, bias))
    fused = kernels(lambda: LG.linear_gelu_epilogue(x, weight, bias))
    assert aten_gelu(eager), eager
    assert not aten_gelu(fused), fused  # cuBLASLt's own kernel may carry "gelu" in its name; aten's must not run


@pytest.mark.gpu
def test_fp32_and_grad_calls_run_eager_exactly_on_cuda():
    x, weight, bias = make_inputs(64, 256, 512, torch.float32, "cuda", 2)
    site = Site("linear_gelu")
    assert torch.equal(linear_gelu(x, weight, bias, site), linear_gelu_ref(x, weight, bias))
    assert dict(site.fallback) == {"dtype float32": 1}


@pytest.mark.gpu
def test_epilogue_under_torch_compile_fullgraph_is_the_custom_op():
    x, weight, bias = make_inputs(4096, 3072, 12288, torch.bfloat16, "cuda", 3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda a, w, b: linear_gelu(a, w, b), fullgraph=True, backend=backend)
    out = fn(x, weight, bias)
    assert "diffusers_fastpath.linear_gelu" in graphs[0].code
    rtol, atol = LG.TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, linear_gelu_ref(x, weight, bias), rtol=rtol, atol=atol)


@pytest.mark.gpu
def test_custom_op_opcheck_cuda():
    x, weight, bias = make_inputs(33, 64, 256, torch.bfloat16, "cuda", 4)
    torch.library.opcheck(torch.ops.diffusers_fastpath.linear_gelu.default, (x, weight, bias))


# --- CPU: why the op is CUDA-only, guards, custom op -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_addmm_activation_is_the_erf_gelu(dtype):
    """torch's CPU ``_addmm_activation(use_gelu=True)`` is addmm then the exact (erf) GELU, not the tanh GELU of
    FLUX's FFNs: that is why the op's guard admits CUDA only and its custom op runs eager off CUDA."""
    x, weight, bias = make_inputs(64, 96, 128, dtype, "cpu", 0)
    out = torch._addmm_activation(bias, x[0], weight.t(), use_gelu=True)
    erf = F.gelu(F.linear(x[0], weight, bias))
    tanh = F.gelu(F.linear(x[0], weight, bias), approximate="tanh")
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else LG.TOLERANCES[dtype]
    torch.testing.assert_close(out, erf, rtol=rtol, atol=atol)
    if dtype == torch.float32:
        assert (out - tanh).abs().max() > 1e-5


def test_custom_op_body_is_eager_off_cuda():
    x, weight, bias = make_inputs(9, 64, 256, torch.bfloat16, "cpu", 1)
    assert torch.equal(torch.ops.diffusers_fastpath.linear_gelu.default(x, weight, bias), linear_gelu_ref(x, weight, bias))


def test_single_rounding_model_of_the_epilogue_is_within_the_tolerances():
    """The epilogue rounds once (GELU of the fp32 pre-activation); eager rounds the pre-activation first. Modelled in
    fp32 on the CPU at FLUX's K = 3072, the stated tolerances hold with room to spare (the GPU test checks the
    real cuBLASLt result)."""
    for dtype in DTYPES:
        rtol, atol = LG.TOLERANCES[dtype]
        x, weight, bias = make_inputs(256, 3072, 2048, dtype, "cpu", 2)
        single = F.gelu(F.linear(x.float(), weight.float(), bias.float()), approximate="tanh").to(dtype)
        ref = linear_gelu_ref(x, weight, bias)
        torch.testing.assert_close(single, ref, rtol=rtol / 2, atol=atol / 2)
        assert not torch.equal(single, ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("cpu", "device cpu"),
        ("fp32", "dtype float32"),
        ("mixed", "mixed dtypes"),
        ("no_bias", "no bias"),
        ("requires_grad", "requires grad"),
        ("empty", "empty"),
        ("shape", "shape"),
    ],
)
def test_guard_sends_the_call_to_eager(case, reason, monkeypatch):
    x, weight, bias = make_inputs(24, 64, 128, torch.bfloat16, "cpu", 3)
    if case == "fp32":
        x, weight, bias = x.float(), weight.float(), bias.float()
    elif case == "mixed":
        weight = weight.half()
    elif case == "no_bias":
        bias = None
    elif case == "requires_grad":
        weight = weight.clone().requires_grad_()
    elif case == "empty":
        x = x[:, :0]
    elif case == "shape":
        x = x[..., :32]
    if case != "cpu":  # let the device check pass here, so that the check under test decides
        monkeypatch.setattr(LG, "_DEVICE_TYPES", ("cuda", "cpu"))
    site = Site("linear_gelu")
    if case in ("shape", "mixed"):  # eager itself raises for these; the guard only has to say why
        assert LG._guard(x, weight, bias) == reason
        return
    out = linear_gelu(x, weight, bias, site)
    assert torch.equal(out, linear_gelu_ref(x, weight, bias))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_custom_op_opcheck_cpu():
    x, weight, bias = make_inputs(9, 64, 256, torch.bfloat16, "cpu", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.linear_gelu.default, (x, weight, bias))
