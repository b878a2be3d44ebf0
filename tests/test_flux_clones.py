"""The FLUX-architecture families under other names (`diffusers_fastpath.models.flux_clones`: LongCat-Image,
Ovis-Image, Bria, Bria-FIBO) on CPU, and at full size on the GPU: exactness, the fused paths' wiring (kernels
emulated on CPU), reversibility, pickling, compilation; a pipeline generation (``OvisImagePipeline``,
``BriaPipeline``; LongCat-Image's and Bria-FIBO's pipelines cannot run without their text encoders) on CPU and at
1024x1024 on the GPU."""

from __future__ import annotations

import functools

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models import flux_clones
from diffusers_fastpath.testing import (FLUX_CLONE_CONFIGS, FLUX_CLONE_PIPELINES, FLUX_CLONES_WITHOUT_PIPELINE,
                                        assert_compiles_fullgraph_exactly, assert_every_site_fast,
                                        assert_generation_and_image_exact_and_fused,
                                        assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        build_flux_clone, build_flux_vae, flux_clone_inputs, flux_clone_pipeline,
                                        flux_clone_prompt_embeddings, patch_round_trip, tiny_flux_clone_pipeline)

CLONES = sorted(FLUX_CLONE_CONFIGS)
FIBO = "BriaFiboTransformer2DModel"
# the clones with a pipeline that runs from given embeddings; the others' params are skipped, with the reason
PIPELINE_CLONES = [pytest.param(name, marks=pytest.mark.skip(reason=FLUX_CLONES_WITHOUT_PIPELINE[name]))
                   if name in FLUX_CLONES_WITHOUT_PIPELINE else name for name in CLONES]
# transformer forwards per denoising step under true CFG: Ovis-Image runs the negative prompt as a second forward,
# Bria batches the two prompts into one
FORWARDS_PER_STEP = {"OvisImagePipeline": 2, "BriaPipeline": 1}


def sites(dual: int, single: int, name: str) -> dict[str, int]:
    """The sites of a model of `name` with that many dual and single blocks (Ovis-Image's single block has no tanh-GELU
    MLP: no GELU + concatenation site; Bria-FIBO's single blocks normalise q and k with diffusers' RMSNorm: their QK
    norm + rotary site is `rmsnorm_rope_real`'s, not FLUX's `qk_norm_rope`)."""
    counts = {"layernorm_scale_shift": 4 * dual + single, "gated_residual": 4 * dual + single, "rotary_emb": dual + single,
              "qk_norm_rope": dual + (0 if name == FIBO else single)}
    if name == FIBO:
        counts["rmsnorm_rope_real"] = single
    if name != "OvisImageTransformer2DModel":
        counts["gelu_cat"] = single
    return counts


def calls(name: str) -> dict:
    """Fast calls per site and forward: q and k, fused with their QK norms (the plain rotary, their fallback, never
    runs)."""
    return {"qk_norm_rope": 2, "rmsnorm_rope_real": 2, "rotary_emb": 0}


def processors(model):
    return [m.processor for m in model.modules() if hasattr(m, "processor")]


@pytest.mark.parametrize("name", CLONES)
def test_supported(name):
    assert name in fp.supported_classes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", CLONES)
def test_patched_matches_unpatched_bitwise(name, dtype):
    assert_patched_equals_unpatched(functools.partial(build_flux_clone, name), flux_clone_inputs, sites(2, 2, name),
                                    dtype, batch=2, grid=(4, 6), txt_tokens=7)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", CLONES)
def test_every_site_on_the_fast_path_is_exact(name, batch, emulated_kernels):
    model = build_flux_clone(name, seed=3)
    assert_patched_step_exact_and_fused(model, flux_clone_inputs(model, batch=batch, seed=4), sites(2, 2, name), calls(name))


@pytest.mark.parametrize("name", CLONES)
def test_unpatch_pickle_and_state_dict(name):
    model = build_flux_clone(name, seed=5)
    before_processors = [type(p) for p in processors(model)]
    with patch_round_trip(model, flux_clone_inputs(model, seed=6)):
        assert processors(model) and all(type(p).__name__.startswith("Fastpath") for p in processors(model))
        assert type(model.transformer_blocks[0]).__module__ == flux_clones.__name__
    assert [type(p) for p in processors(model)] == before_processors


@pytest.mark.parametrize("name", CLONES)
def test_compiles_with_fullgraph(name):
    model = build_flux_clone(name, seed=7)
    assert_compiles_fullgraph_exactly(model, flux_clone_inputs(model, seed=8))


@pytest.mark.parametrize("name", PIPELINE_CLONES)
def test_pipeline_generation_is_identical_and_fused(name, emulated_kernels):
    """A 3-step generation at 64x64 through the clone's pipeline (tiny random VAE, no text encoder) with true
    classifier-free guidance from random prompt and negative-prompt embeddings (the prompt zero-padded, as the
    pipelines pad): md5-identical latents and decoded image, every site fast at every forward."""
    pipe = tiny_flux_clone_pipeline(name, seed=13)
    assert type(pipe).__name__ == FLUX_CLONE_PIPELINES[name]
    call = flux_clone_prompt_embeddings(pipe, seed=14)
    assert_generation_and_image_exact_and_fused(pipe, dict(call, guidance_scale=4.0), sites(2, 2, name), calls(name),
                                                forwards_per_step=FORWARDS_PER_STEP[type(pipe).__name__], steps=3,
                                          size=64)


@pytest.mark.parametrize("name", sorted(FLUX_CLONES_WITHOUT_PIPELINE))
def test_no_pipeline_without_a_text_encoder(name):
    """LongCat-Image's and Bria-FIBO's pipelines cannot run from embeddings: `flux_clone_pipeline` says why."""
    with pytest.raises(ValueError, match="no pipeline without a text encoder"):
        flux_clone_pipeline(build_flux_clone(name), build_flux_vae())


# --- GPU: the class defaults (FLUX.1's 19 + 38 blocks, Ovis-Image's 6 + 27) at 1024x1024: one step, a generation ---


@pytest.mark.gpu
@pytest.mark.parametrize("name", CLONES)
@torch.no_grad()
def test_full_size_one_step_1024_is_bitwise_identical_and_fully_fused(name, unpatch_after):
    model = build_flux_clone(name, torch.bfloat16, "cuda", seed=0, tiny=False)
    try:
        inputs = flux_clone_inputs(model, grid=(64, 64), txt_tokens=512, seed=9)
        ref = model(**inputs).sample
        assert torch.isfinite(ref).all() and ref.std() > 0.01
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
        counts = sites(len(model.transformer_blocks), len(model.single_transformer_blocks), name)
        assert_every_site_fast(fp.report(model), counts, calls(name))
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
@pytest.mark.parametrize("name", PIPELINE_CLONES)
def test_full_size_generation_1024_is_md5_identical_and_fused(name):
    """A 4-step generation at 1024x1024 with the class defaults (Ovis-Image's 6 + 27 blocks, Bria 3.2's 19 + 38)
    and FLUX.1's published VAE (random weights) decoding, true CFG from random embeddings as long as the pipeline's
    text encoder gives (Ovis-Image: 256 tokens; Bria: 128): latents and image md5-identical patched and unpatched,
    every site fast at every forward."""
    model = build_flux_clone(name, torch.bfloat16, "cuda", seed=0, tiny=False)
    pipe = None
    try:
        pipe = flux_clone_pipeline(model, build_flux_vae("flux-dev", torch.bfloat16, "cuda", seed=1))
        txt_tokens = {"OvisImagePipeline": 256, "BriaPipeline": 128}[type(pipe).__name__]
        call = flux_clone_prompt_embeddings(pipe, txt_tokens=txt_tokens, seed=2, padding=txt_tokens // 2)
        counts = sites(len(model.transformer_blocks), len(model.single_transformer_blocks), name)
        assert_generation_and_image_exact_and_fused(pipe, dict(call, guidance_scale=4.0), counts, calls(name), steps=4,
                                                    size=1024, forwards_per_step=FORWARDS_PER_STEP[type(pipe).__name__])
    finally:
        del model, pipe
        torch.cuda.empty_cache()
