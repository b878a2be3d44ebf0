"""linear_cat: two projections written into their token concatenation (FLUX's and Chroma's joint values), exact on
the GPU at FLUX shapes; its guard, verification and fallbacks everywhere; the FLUX processor's use of it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.ops import linear_cat, linear_cat_ref
from diffusers_fastpath.ops.linear_cat import BATCH_REASON, LINEAR_CAT, _guard
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

DTYPES = [torch.bfloat16, torch.float16]


def make_inputs(text, image, k, n, dtype, device, seed, batch=1):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    return (rand(batch, text, k), rand(n, k, scale=k ** -0.5), rand(n), rand(batch, image, k),
            rand(n, k, scale=k ** -0.5), rand(n))


def poison_allocator(nbytes: int) -> None:
    """Leave NaNs in the caching allocator's free blocks, where the op's next output is likely to be allocated."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()


# --- GPU: the contract at FLUX shapes ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("text,image", [(512, 4096), (512, 1024), (256, 4096), (77, 3600), (512, 4080)])
def test_joint_values_match_eager_bitwise(dtype, text, image):
    """FLUX.1-dev (3072 -> 3072) at 1024x1024, 512x512, shorter prompts and 1360x768; fresh random inputs, the
    allocator poisoned before each call, and the op not disabled (it verified itself on the first)."""
    LINEAR_CAT.reset()
    site = fp.ops.Site("linear_cat")
    for seed in range(3):
        args = make_inputs(text, image, 3072, 3072, dtype, "cuda", seed)
        ref = linear_cat_ref(*args)
        poison_allocator(2 * ref.numel() * ref.element_size())
        out = linear_cat(*args, site=site)
        assert not out.isnan().any() and torch.equal(out, ref)
    assert LINEAR_CAT.disabled is None and site.fast == 3 and not site.fallback


@pytest.mark.gpu
def test_batch_two_and_unaligned_halves_run_eager_on_the_gpu():
    site = fp.ops.Site("linear_cat")
    args = make_inputs(7, 9, 64, 40, torch.bfloat16, "cuda", 0, batch=2)
    assert torch.equal(linear_cat(*args, site=site), linear_cat_ref(*args))
    args = make_inputs(7, 9, 64, 40, torch.bfloat16, "cuda", 1)  # 7 rows x 80 bytes: the second half at 560 bytes
    assert torch.equal(linear_cat(*args, site=site), linear_cat_ref(*args))
    assert site.fast == 0 and set(site.fallback) == {BATCH_REASON, "second half not 256-byte aligned"}


# --- everywhere: guard and fallback ----------------------------------------------------------------------------


def test_cpu_runs_eager_and_counts_why():
    site = fp.ops.Site("linear_cat")
    args = make_inputs(3, 5, 8, 128, torch.bfloat16, "cpu", 0)
    out = linear_cat(*args, site=site)
    assert torch.equal(out, linear_cat_ref(*args)) and out.shape == (1, 8, 128)
    assert site.fast == 0 and dict(site.fallback) == {"device cpu": 1}


@pytest.mark.parametrize("case,reason", [
    ("fp32", "dtype float32"),
    ("mixed", "mixed dtypes"),
    ("batch", BATCH_REASON),
    ("strided", "input not contiguous"),
    ("unaligned", "second half not 256-byte aligned"),
    ("grad", "requires grad"),
    ("n", "shape"),
    ("bias", "no bias"),
])
def test_guard_reasons(case, reason):
    xa, wa, ba, xb, wb, bb = make_inputs(4, 6, 16, 128, torch.bfloat16, "cpu", 0)
    if case == "fp32":
        xa, wa, ba, xb, wb, bb = (t.float() for t in (xa, wa, ba, xb, wb, bb))
    elif case == "mixed":
        bb = bb.half()
    elif case == "batch":
        xa, xb = xa.expand(2, -1, -1).contiguous(), xb.expand(2, -1, -1).contiguous()
    elif case == "strided":
        xb = torch.randn(1, 6, 32).to(torch.bfloat16)[..., ::2]
    elif case == "unaligned":
        wa, ba, wb, bb = wa[:40], ba[:40], wb[:40], bb[:40]  # 4 rows x 80 bytes
    elif case == "grad":
        wa = wa.clone().requires_grad_()
    elif case == "n":
        wb, bb = wb[:64], bb[:64]
    elif case == "bias":
        bb = None  # a Linear without a bias: eager accepts it, the guard refuses it without raising
    assert _guard(xa, wa, ba, xb, wb, bb) == reason
    assert _guard(*make_inputs(4, 6, 16, 128, torch.bfloat16, "cpu", 0)) == "device cpu"


# --- the FLUX processor ------------------------------------------------------------------------------------------


def value_sites(model):
    return [s for s in fp.report(model).sites if s.op == "linear_cat"]


def test_flux_dual_blocks_get_a_value_site_and_stay_exact(unpatch_after):
    model = build_flux_transformer(seed=21)
    inputs = flux_transformer_inputs(model, seed=22)
    with torch.no_grad():
        ref = model(**inputs).sample
    fp.patch(model)
    unpatch_after(model)
    sites = value_sites(model)
    assert len(sites) == len(model.transformer_blocks) and all(s.site.endswith(":value_cat") for s in sites)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)
    assert all(s.fallback == 1 and s.reasons == {"device cpu": 1} for s in value_sites(model))
    fp.unpatch(model)
    assert not any("_fastpath_site_value_cat" in m.__dict__ for m in model.modules())


def test_projections_that_must_run_as_modules_do(unpatch_after):
    """A wrapper that is not a plain nn.Linear (as LoRA's) gets no site; a hook put on a value projection after patching
    sends the site to diffusers' own ``_get_qkv_projections``, counted with the reason; both outputs stay eager's."""
    model = build_flux_transformer(seed=23)
    inputs = flux_transformer_inputs(model, seed=24)
    attn0, attn1 = (b.attn for b in model.transformer_blocks[:2])

    class Scaled(nn.Linear):  # stands for a wrapper whose forward is not nn.Linear's
        def forward(self, x):
            return super().forward(x) * 2

    wrapped = Scaled(attn0.to_v.in_features, attn0.to_v.out_features, dtype=attn0.to_v.weight.dtype)
    wrapped.load_state_dict(attn0.to_v.state_dict())
    attn0.to_v = wrapped
    with torch.no_grad():
        ref = model(**inputs).sample
    fp.patch(model)
    unpatch_after(model)
    seen = []
    attn1.add_v_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)
    assert len(seen) == 1  # the hooked projection ran as a module
    reasons = {s.site.split(":")[0]: s.reasons for s in value_sites(model)}
    assert "transformer_blocks.0.attn" not in reasons  # not a plain nn.Linear at patch time: no site at all
    assert reasons["transformer_blocks.1.attn"] == {"a value projection has hooks": 1}


def test_fused_projections_run_diffusers_own(unpatch_after):
    """Projections fused after patching (``fuse_qkv_projections``): the site runs diffusers' ``_get_fused_projections``,
    counted; fused before patching, the modules get no site at all."""
    reference = build_flux_transformer(seed=25)
    reference.fuse_qkv_projections()
    inputs = flux_transformer_inputs(reference, seed=26)
    with torch.no_grad():
        ref = reference(**inputs).sample
    fp.patch(reference)
    unpatch_after(reference)
    assert not value_sites(reference)
    model = build_flux_transformer(seed=25)
    fp.patch(model)
    unpatch_after(model)
    model.fuse_qkv_projections()
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, ref)
    sites = value_sites(model)
    assert sites and all(s.fast == 0 and s.reasons == {"fused projections (to_qkv)": 1} for s in sites)
