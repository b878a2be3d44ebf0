"""layer_norm_affine ("high"): the fold's numerics against the lossless path, its B == 1 guard, the custom op."""

from __future__ import annotations

import sys

import pytest
import torch

from diffusers_fastpath.ops import Site, layer_norm_affine, layer_norm_affine_ref, modulate_scale_shift_ref

LNA = sys.modules["diffusers_fastpath.ops.layer_norm_affine"]  # the module (the package exports the function)
FLUX_SHAPES = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072)]
DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6


def make_inputs(shape, dtype, device, seed):
    """x and the adaLN scale/shift as diffusers makes them: views of ``emb.chunk(6, dim=1)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, _, d = shape
    x = (torch.randn(shape, generator=gen, device=device) * 4 + 1).to(dtype)
    emb = torch.randn(b, 6 * d, generator=gen, device=device).to(dtype)
    shift, scale = emb.chunk(6, dim=1)[:2]
    return x, scale, shift


def layer_norm(dim, device="cpu"):
    return torch.nn.LayerNorm(dim, elementwise_affine=False, eps=EPS, device=device)


def exact(x, scale, shift):
    """float64 reference of ``layer_norm(x) * (1 + scale) + shift`` (scale's ``1 + scale`` rounded as eager does)."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = xd.var(-1, unbiased=False, keepdim=True)
    return (xd - mean) / torch.sqrt(var + EPS) * (1 + scale).double()[:, None] + shift.double()[:, None]


def rms(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


# --- GPU: the contract -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=str)
def test_fold_is_close_to_lossless_at_flux_shapes(shape, dtype):
    norm = layer_norm(shape[-1], "cuda")
    for seed in range(2):  # fresh inputs each round
        x, scale, shift = make_inputs(shape, dtype, "cuda", seed)
        lossless = layer_norm_affine_ref(norm, x, scale, shift)
        assert torch.equal(lossless, modulate_scale_shift_ref(norm(x), scale, shift))
        site = Site("layer_norm_affine")
        out = layer_norm_affine(norm, x, scale, shift, site)
        assert site.fast == 1 and not site.fallback, site
        torch.testing.assert_close(out, lossless, atol=LNA.ATOL, rtol=LNA.RTOL)
        assert not torch.equal(out, lossless)  # the folded path really ran (it rounds once, not three times)
        assert rms(out, exact(x, scale, shift)) <= rms(lossless, exact(x, scale, shift))  # and is no less accurate


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batch_2_takes_the_lossless_path_bitwise(dtype):
    norm = layer_norm(3072, "cuda")
    x, scale, shift = make_inputs((2, 1024, 3072), dtype, "cuda", 3)
    site = Site("layer_norm_affine")
    out = layer_norm_affine(norm, x, scale, shift, site)
    assert torch.equal(out, modulate_scale_shift_ref(norm(x), scale, shift))
    assert site.fast == 0 and dict(site.fallback) == {"batch 2 (the folded affine is one row)": 1}


@pytest.mark.gpu
def test_fold_under_torch_compile_fullgraph_is_the_custom_op():
    norm = layer_norm(3072, "cuda")
    x, scale, shift = make_inputs((1, 4096, 3072), torch.bfloat16, "cuda", 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda a, b, c: layer_norm_affine(norm, a, b, c), fullgraph=True, backend=backend)
    out = fn(x, scale, shift)
    assert torch.equal(out, LNA.folded_layer_norm(x, scale, shift, EPS))
    assert "diffusers_fastpath.layer_norm_affine" in graphs[0].code


# --- CPU: the fold's numerics, guards, custom op -----------------------------------------------------------------


def test_fold_body_matches_the_formula_in_fp32():
    x, scale, shift = make_inputs((1, 64, 256), torch.float32, "cpu", 0)
    out = LNA.folded_layer_norm(x, scale, shift, EPS)
    torch.testing.assert_close(out.double(), exact(x, scale, shift), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 512, 3072), (1, 17, 64)], ids=str)
def test_fold_body_is_within_the_contract_and_no_less_accurate(shape, dtype):
    """The CPU LayerNorm computes in fp32 and rounds once, as the CUDA one does: the same contract holds."""
    x, scale, shift = make_inputs(shape, dtype, "cpu", 1)
    norm = layer_norm(shape[-1])
    lossless = modulate_scale_shift_ref(norm(x), scale, shift)
    out = LNA.folded_layer_norm(x, scale, shift, EPS)
    torch.testing.assert_close(out, lossless, atol=LNA.ATOL, rtol=LNA.RTOL)
    assert rms(out, exact(x, scale, shift)) <= rms(lossless, exact(x, scale, shift))
    if shape[1] > 100:
        assert not torch.equal(out, lossless)  # one rounding instead of three changes some outputs


@pytest.mark.parametrize(
    "case, reason",
    [
        ("batch2", "batch 2 (the folded affine is one row)"),
        ("cpu", "device cpu"),
        ("fp32", "dtype float32"),
        ("affine", "LayerNorm has its own affine"),
        ("requires_grad", "requires grad"),
        ("empty", "empty"),
        ("shape", "shape"),
    ],
)
def test_guard_sends_the_call_to_the_lossless_path(case, reason, monkeypatch):
    shape = (2, 24, 64) if case == "batch2" else (1, 24, 64)
    x, scale, shift = make_inputs(shape, torch.bfloat16, "cpu", 2)
    norm = layer_norm(64)
    if case == "fp32":
        x, scale, shift = x.float(), scale.float(), shift.float()
    elif case == "affine":
        norm = torch.nn.LayerNorm(64, eps=EPS)
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "empty":
        x = x[:, :0]
    elif case == "shape":
        x = x[0]
    if case != "cpu":  # let the device check pass here, so that the check under test decides
        monkeypatch.setattr(LNA, "_DEVICE_TYPES", ("cuda", "cpu"))
    site = Site("layer_norm_affine")
    out = layer_norm_affine(norm, x, scale, shift, site)
    assert torch.equal(out, modulate_scale_shift_ref(norm(x), scale, shift))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_guarded_call_runs_the_fold(monkeypatch):
    monkeypatch.setattr(LNA, "_DEVICE_TYPES", ("cuda", "cpu"))
    x, scale, shift = make_inputs((1, 200, 512), torch.bfloat16, "cpu", 5)
    site = Site("layer_norm_affine")
    out = layer_norm_affine(layer_norm(512), x, scale, shift, site)
    assert torch.equal(out, LNA.folded_layer_norm(x, scale, shift, EPS)) and site.fast == 1


def test_custom_op_opcheck_cpu():
    x, scale, shift = make_inputs((1, 9, 64), torch.bfloat16, "cpu", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.layer_norm_affine.default, (x, scale, shift, EPS))


def test_compiled_call_is_the_custom_op(monkeypatch):
    monkeypatch.setattr(LNA, "_DEVICE_TYPES", ("cuda", "cpu"))
    norm = layer_norm(64)
    x, scale, shift = make_inputs((1, 16, 64), torch.bfloat16, "cpu", 6)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda a, b, c: layer_norm_affine(norm, a, b, c), fullgraph=True, backend=backend)
    assert torch.equal(fn(x, scale, shift), LNA.folded_layer_norm(x, scale, shift, EPS))
    assert "diffusers_fastpath.layer_norm_affine" in graphs[0].code
    x2, scale2, shift2 = make_inputs((2, 16, 64), torch.bfloat16, "cpu", 7)  # B == 2: traced to the lossless path
    assert torch.equal(fn(x2, scale2, shift2), modulate_scale_shift_ref(norm(x2), scale2, shift2))
