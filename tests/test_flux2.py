"""FLUX.2 (``Flux2Transformer2DModel``) through the shared pieces: on CPU exactness, the fused paths' wiring (kernels
emulated, the already-broadcast modulation rows included), a pipeline generation (``Flux2Pipeline`` and klein's),
reversibility, pickling, compilation; on the GPU the FLUX.2-dev and klein configs at 1024x1024, one step and a
whole generation."""

from __future__ import annotations

import collections

import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock, Flux2TransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import flux2
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly,
                                        assert_generation_and_image_exact_and_fused,
                                        assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        build_flux2_transformer, build_flux2_vae, flux2_pipeline,
                                        flux2_prompt_embeddings, flux2_transformer_inputs, patch_round_trip,
                                        tiny_flux2_pipeline)


def sites(dual: int, single: int) -> dict[str, int]:
    # silu_mul: the dual blocks' two feed-forwards' Flux2SwiGLU; swiglu_cat: the single blocks' MLP one, written into
    # the concatenation with the attention output
    return {"layernorm_scale_shift": 4 * dual + single, "gated_residual": 4 * dual + single, "rotary_emb": dual + single,
            "qk_norm_rope": dual + single, "silu_mul": 2 * dual, "swiglu_cat": single}


# q and k per forward through the fused QK norm + rotary; its fallback, the plain rotary, never runs
CALLS = {"qk_norm_rope": 2, "rotary_emb": 0}


def test_flux2_is_supported():
    assert "Flux2Transformer2DModel" in fp.supported_classes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_matches_unpatched_bitwise(dtype, batch):
    assert_patched_equals_unpatched(build_flux2_transformer, flux2_transformer_inputs, sites(2, 2), dtype, batch=batch,
                                    grid=(4, 6), txt_tokens=7)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_flux2_transformer(seed=3)
    assert_patched_step_exact_and_fused(model, flux2_transformer_inputs(model, batch=batch, seed=4), sites(2, 2), CALLS)


@pytest.mark.parametrize("guidance_embeds, pipeline", [(True, "Flux2Pipeline"), (False, "Flux2KleinPipeline")],
                         ids=["dev", "klein"])
def test_pipeline_generation_is_identical_and_fused(guidance_embeds, pipeline, emulated_kernels):
    """A 3-step generation at 128x128 through the tiny FLUX.2 pipeline (random latent batch-norm stats, so the
    pipeline's denormalisation is not the identity): md5-identical latents and decoded image, every site fast at
    every step. With a guidance embedding, ``Flux2Pipeline``; without (klein's distilled model),
    ``Flux2KleinPipeline``."""
    pipe = tiny_flux2_pipeline(build_flux2_transformer(seed=13, guidance_embeds=guidance_embeds), seed=13)
    assert type(pipe).__name__ == pipeline
    assert_generation_and_image_exact_and_fused(pipe, flux2_prompt_embeddings(pipe, seed=14), sites(2, 2), CALLS,
                                                steps=3, size=128)


def test_unpatch_pickle_and_state_dict():
    model = build_flux2_transformer(seed=5)
    with patch_round_trip(model, flux2_transformer_inputs(model, seed=6)):
        assert isinstance(model.transformer_blocks[0], Flux2TransformerBlock)
        assert type(model.single_transformer_blocks[0]) is flux2.FastpathFlux2SingleTransformerBlock
    assert type(model.single_transformer_blocks[0]) is Flux2SingleTransformerBlock


def test_swiglu_cat_counts_where_the_act_cannot_run_inside_it(emulated_kernels, monkeypatch):
    """The single blocks' SwiGLU + concatenation: a forward hook on one block's ``mlp_act_fn`` (it runs, and the
    output is the unpatched model's with the same hook), or a SwiGLU class this package has not checked by digest
    (`register_swiglu`), runs the two statements as written and counts the reason on the ``swiglu_cat`` site."""
    from diffusers_fastpath.models import _chain_calls

    ref, model = build_flux2_transformer(seed=11), build_flux2_transformer(seed=11)
    inputs = flux2_transformer_inputs(model, seed=12)
    calls = []
    for m in (ref, model):
        m.single_transformer_blocks[0].attn.mlp_act_fn.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 2)
    fp.patch(model)
    try:
        with torch.no_grad():
            assert torch.equal(model(**inputs).sample, ref(**inputs).sample)
            assert len(calls) == 2
            rows = {s.site: s for s in fp.report(model).sites if s.op == "swiglu_cat"}
            hooked, free = (rows[f"single_transformer_blocks.{i}.attn.mlp_act_fn:swiglu_cat"] for i in (0, 1))
            assert (hooked.fast, dict(hooked.reasons)) == (0, {"FastpathFlux2SwiGLU has hooks": 1})
            assert (free.fast, free.fallback) == (1, 0)
            monkeypatch.setattr(_chain_calls, "SWIGLU_MODULES", {})  # as if the installed forward's digest differed
            assert torch.equal(model(**inputs).sample, ref(**inputs).sample)
            rows = {s.site: s for s in fp.report(model).sites if s.op == "swiglu_cat"}
            free = rows["single_transformer_blocks.1.attn.mlp_act_fn:swiglu_cat"]
            assert (free.fast, dict(free.reasons)) == (1, {"FastpathFlux2SwiGLU is not a SwiGLU this package knows": 1})
    finally:
        fp.unpatch(model)


def test_compiles_with_fullgraph():
    model = build_flux2_transformer(seed=7)
    assert_compiles_fullgraph_exactly(model, flux2_transformer_inputs(model, seed=8))


@pytest.mark.gpu
@pytest.mark.full_size
@pytest.mark.parametrize("config, blocks", [("flux2-dev", (8, 48)), ("flux2-klein", (5, 20))])
@torch.no_grad()
def test_flux2_one_step_1024_is_bitwise_identical(config, blocks, unpatch_after):
    """FLUX.2-dev's config (60 GiB of bf16 weights) and FLUX.2-klein-4B's (7 GiB, hidden 3072, no guidance
    embedding): bit-identical, and every site fused: the gated residuals, the rotary embeddings and the LayerNorm +
    modulate rows (dev: D = 6144, the widest the LayerNorm kernel holds; its first call per signature verified
    against eager)."""
    model = build_flux2_transformer(config, torch.bfloat16, "cuda", seed=0)
    try:
        inputs = flux2_transformer_inputs(model, grid=(64, 64), txt_tokens=512, seed=9)
        ref = model(**inputs).sample
        assert torch.isfinite(ref).all() and ref.std() > 0.01
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
        rep = fp.report(model)
        assert collections.Counter(s.op for s in rep.sites) == sites(*blocks)
        for s in rep.sites:
            assert s.fast == CALLS.get(s.op, 1) and s.fallback == 0, str(rep)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
@pytest.mark.parametrize("config, blocks", [("flux2-dev", (8, 48)), ("flux2-klein", (5, 20))])
def test_flux2_generation_1024_is_md5_identical_and_fused(config, blocks):
    """A 4-step generation at 1024x1024 from 512 text tokens, FLUX.2's published VAE (random weights) decoding:
    dev through ``Flux2Pipeline`` (60 GiB of bf16 weights, guidance 4), klein through ``Flux2KleinPipeline``
    (distilled: no guidance); latents and image md5-identical patched and unpatched, every site fast at every
    step."""
    model = build_flux2_transformer(config, torch.bfloat16, "cuda", seed=0)
    pipe = None
    try:
        pipe = flux2_pipeline(model, build_flux2_vae("flux2-dev", torch.bfloat16, "cuda", seed=1))
        call = flux2_prompt_embeddings(pipe, txt_tokens=512, seed=2)
        assert_generation_and_image_exact_and_fused(pipe, call, sites(*blocks), CALLS, steps=4, size=1024)
    finally:
        del model, pipe
        torch.cuda.empty_cache()
