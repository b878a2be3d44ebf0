"""The "high" tier on the GPU: whole generations close to lossless, every site on the approximate path, and the
lossless tier still bit-identical after the context."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.metrics import psnr, ssim
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs, prompt_embeddings, tiny_flux_pipeline

pytestmark = pytest.mark.gpu

FLUX_DEV_GELU_SITES = 19 * 2 + 38


def md5(a) -> str:
    return hashlib.md5(a.tobytes()).hexdigest()


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (out.double() - ref.double()).pow(2).mean().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.double().pow(2).mean().item() / noise)


@pytest.fixture(scope="module")
def flux_dev():
    model = build_flux_transformer("flux-dev", torch.bfloat16, "cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_pipeline_high_generation_is_close_and_lossless_stays_identical(dtype, unpatch_after):
    pipe = tiny_flux_pipeline(dtype=dtype, device="cuda", seed=3)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, txt_tokens=16)

    def generate():
        gen = torch.Generator("cuda").manual_seed(0)
        return pipe(**emb, height=128, width=128, num_inference_steps=4, generator=gen, output_type="np").images

    unpatched = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    with fp.quality(pipe, "high"):
        high = generate()
        rep = fp.report(pipe)
    lossless = generate()
    assert md5(lossless) == md5(unpatched)
    assert not (high == unpatched).all()  # the approximate path ran
    p, s = psnr(high, unpatched), ssim(high, unpatched)
    print(f"tiny FLUX {dtype}: high vs lossless PSNR {p:.2f} dB, SSIM {s:.5f}")
    assert p >= 35 and s >= 0.97
    assert rep.models[0].quality == "high"
    assert all(t.fast == 4 and t.fallback == 0 for t in rep.tier_sites), str(rep)


def test_tiny_model_high_compiles_fullgraph_with_the_custom_ops(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=31)
    inputs = flux_transformer_inputs(model, grid=(8, 8), txt_tokens=16, seed=32)
    fp.patch(model)
    unpatch_after(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    with torch.no_grad(), fp.quality(model, "high"):
        eager = model(**inputs).sample
        out = torch.compile(model, fullgraph=True, backend=backend)(**inputs).sample
    code = graphs[0].code
    assert code.count("diffusers_fastpath.linear_gelu") == 2 * 2 + 2
    assert torch.equal(out, eager)  # aot_eager runs the same aten kernels as eager


@torch.no_grad()
def test_flux_dev_one_step_high_runs_every_site_and_stays_close(flux_dev, unpatch_after):
    inputs = flux_transformer_inputs(flux_dev, grid=(64, 64), txt_tokens=512, seed=5)  # 1024x1024
    ref = flux_dev(**inputs).sample
    fp.patch(flux_dev)
    unpatch_after(flux_dev)
    with fp.quality(flux_dev, "high"):
        out = flux_dev(**inputs).sample
        rep = fp.report(flux_dev)
    assert torch.equal(flux_dev(**inputs).sample, ref)  # lossless again after the context
    ops = [t.op for t in rep.tier_sites]
    assert ops == ["linear_gelu"] * FLUX_DEV_GELU_SITES
    assert all(t.mounted and t.fast == 1 and t.fallback == 0 for t in rep.tier_sites), str(rep)
    db = sqnr_db(out, ref)
    print(f"FLUX.1-dev config, one step at 1024x1024: high vs lossless SQNR {db:.1f} dB, max abs diff "
          f"{(out.float() - ref.float()).abs().max().item():.4f}")
    assert torch.isfinite(out).all() and db >= 25  # a wrong epilogue (say, the erf GELU) gives far less


@torch.no_grad()
def test_flux_dev_batch2_high_runs_the_epilogue_at_every_site(flux_dev, unpatch_after):
    inputs = flux_transformer_inputs(flux_dev, batch=2, grid=(24, 40), txt_tokens=77, seed=6)
    ref = flux_dev(**inputs).sample
    fp.patch(flux_dev, quality="high")
    unpatch_after(flux_dev)
    out = flux_dev(**inputs).sample
    rep = fp.report(flux_dev)
    assert rep.tier_sites and all(t.fast == 1 and t.op == "linear_gelu" for t in rep.tier_sites)
    assert not torch.equal(out, ref) and sqnr_db(out, ref) >= 25


@torch.no_grad()
def test_flux_dev_pipeline_28_steps_1024_high_psnr_ssim(flux_dev, unpatch_after):
    """The tier's end-to-end contract: a whole 28-step 1024x1024 generation, decoded, PSNR >= 35 dB and SSIM >= 0.97
    against lossless; and the lossless image after the context is md5-identical to unpatched."""
    pipe = tiny_flux_pipeline(transformer=flux_dev, device="cuda", seed=7)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, txt_tokens=512, seed=8)

    def generate():
        gen = torch.Generator("cuda").manual_seed(9)
        return pipe(**emb, height=1024, width=1024, num_inference_steps=28, generator=gen, output_type="np").images

    unpatched = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    with fp.quality(pipe, "high"):
        high = generate()
    assert md5(generate()) == md5(unpatched)
    p, s = psnr(high, unpatched), ssim(high, unpatched)
    print(f"FLUX.1-dev config, 28 steps at 1024x1024: high vs lossless PSNR {p:.2f} dB, SSIM {s:.5f}")
    assert p >= 35 and s >= 0.97
