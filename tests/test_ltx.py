"""LTX-Video (``LTXVideoTransformer3DModel``) through the shared pieces: on CPU exactness (padded prompts, several
latent frames), the fused gated residuals', RMSNorm + modulates' and rotary's wiring (kernels emulated), reversibility,
pickling, compilation; on the GPU the LTX-Video config at 768x512x121 (6,144 tokens)."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import ltx
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_patched_step_exact_and_fused, assert_pipeline_generation_exact_and_fused,
                                        build_ltx_transformer, ltx_pipeline, ltx_prompt_embeddings,
                                        ltx_transformer_inputs, patch_round_trip)


def sites(blocks: int) -> dict[str, int]:
    # per block: both gated residuals, norm1's and norm2's weightless RMSNorm with its per-token modulate, and the
    # self-attention's QK norms across all heads with its rotary (q and k: one call of one site; the rotary's own site is
    # the fallback's)
    return {"gated_residual": 2 * blocks, "rmsnorm_modulate": 2 * blocks, "rotary_emb": blocks,
            "qk_norm_rows_rope_pair": blocks}


CALLS = {"qk_norm_rows_rope_pair": 1, "rotary_emb": 0}  # q and k in one call


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_ltx_is_supported():
    assert "LTXVideoTransformer3DModel" in fp.supported_classes()
    assert ltx._BLOCK.gates == ["gate_msa", "gate_mlp"] and ltx._BLOCK.norms == ["norm1", "norm2"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch, padding", [(1, 0), (2, 3)], ids=["b1", "b2-padded"])
def test_patched_matches_unpatched_bitwise(dtype, batch, padding):
    assert_patched_equals_unpatched(build_ltx_transformer, ltx_transformer_inputs, sites(2), dtype, batch=batch,
                                    grid=(4, 6), frames=3, txt_tokens=7, padding=padding)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_ltx_transformer(seed=3)
    assert_patched_step_exact_and_fused(model, ltx_transformer_inputs(model, batch=batch, seed=4), sites(2), CALLS)


def test_pipeline_generation_with_cfg_is_identical(emulated_kernels):
    """`LTXPipeline`, 3 steps with CFG (a padded prompt and its negative): md5-identical latents, every site fast."""
    pipe = ltx_pipeline(build_ltx_transformer(seed=11))
    assert_pipeline_generation_exact_and_fused(pipe, dict(
        ltx_prompt_embeddings(pipe, seed=12), height=64, width=96, num_frames=9, guidance_scale=3.0),
        idle=("rotary_emb",))


def test_unpatch_pickle_and_state_dict():
    model = build_ltx_transformer(seed=5)
    with patch_round_trip(model, ltx_transformer_inputs(model, seed=6)):
        assert type(model.transformer_blocks[0]) is ltx.FastpathLTXVideoTransformerBlock
    assert type(model.transformer_blocks[0]) is LTXVideoTransformerBlock


def test_compiles_with_fullgraph():
    model = build_ltx_transformer(seed=7)
    assert_compiles_fullgraph_exactly(model, ltx_transformer_inputs(model, seed=8))


@pytest.mark.gpu
@pytest.mark.full_size
def test_ltx_video_one_step_is_bitwise_identical_and_fused():
    """LTX-Video's config (2B) at 768x512, 121 frames (16 latent frames of 16x24: 6,144 tokens), a padded prompt:
    bit-identical, every gated residual, RMSNorm + modulate and rotary fused."""
    model = build_ltx_transformer("ltx-video", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = ltx_transformer_inputs(model, grid=(16, 24), frames=16, txt_tokens=128, seed=9, padding=30)
        assert_patched_step_exact_and_fused(model, inputs, sites(28), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_ltx_video_generation_with_cfg_is_md5_identical():
    """`LTXPipeline` around the LTX-Video config at 768x512x121, 3 steps with CFG (a batch of 2 per forward: the
    prompt, padded, and its negative): the latents md5-identical to unpatched, every site fast on every forward."""
    pipe = ltx_pipeline(build_ltx_transformer("ltx-video", torch.bfloat16, "cuda", seed=0))
    try:
        assert_pipeline_generation_exact_and_fused(pipe, dict(
            ltx_prompt_embeddings(pipe, tokens=128, padding=40, seed=12), height=512, width=768, num_frames=121,
            guidance_scale=3.0), idle=("rotary_emb",))
    finally:
        del pipe
        torch.cuda.empty_cache()
