"""SD3 / SD3.5 (``SD3Transformer2DModel``) through the shared pieces: on CPU exactness (SD3.5's QK RMSNorm and a
dual-attention block included), the fused paths' wiring (kernels emulated), reversibility, pickling, compilation; on
the GPU the SD3.5-large config at 1024x1024."""

from __future__ import annotations

import collections

import pytest
import torch
from diffusers.models.attention import JointTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import sd3
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_pipeline_generation_exact_and_fused, build_sd3_transformer,
                                        patch_round_trip, sd3_pipeline, sd3_prompt_embeddings, sd3_transformer_inputs)

# the tiny config's 3 blocks: the first with dual attention (SD35AdaLayerNormZeroX: its two modulates fused, its
# LayerNorm eager), the last context-pre-only
# (and 14 QK norms: four in each block's joint attention, two in block 0's second, image-only attention; four
# processors with the head-concatenation and token-major attention sites, of which the three joint ones concatenate
# q, k and v token-major and run their attention on them; the image-only attention runs as written)
TINY_SITES = {"layernorm_scale_shift": 9, "gated_residual": 15, "modulate_scale_shift": 2, "rmsnorm": 14,
              "cat_heads": 4, "attention_seq_major": 4}
TINY_FAST = {"layernorm_scale_shift": 9, "gated_residual": 5 + 4 + 2,  # gates that run: the dual one only in block 0,
             "modulate_scale_shift": 2, "rmsnorm": 14,                  # the context ones not in the last block
             "cat_heads": 3 * 3, "attention_seq_major": 3}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def fast_calls(rep) -> dict[str, int]:
    assert all(s.fallback == 0 and s.fast <= (3 if s.op == "cat_heads" else 1) for s in rep.sites), str(rep)
    calls = collections.Counter()
    for s in rep.sites:
        calls[s.op] += s.fast
    return dict(calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_matches_unpatched_bitwise(dtype, batch):
    assert "SD3Transformer2DModel" in fp.supported_classes()
    assert_patched_equals_unpatched(build_sd3_transformer, sd3_transformer_inputs, TINY_SITES, dtype, batch=batch)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_reached_site_on_the_fast_path_is_exact(batch, emulated_kernels, unpatch_after):
    model = build_sd3_transformer(seed=3)
    inputs = sd3_transformer_inputs(model, batch=batch, seed=4)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    assert fast_calls(fp.report(model)) == TINY_FAST


def test_pipeline_generation_with_cfg_is_identical_and_fused(emulated_kernels):
    """A 3-step ``StableDiffusion3Pipeline`` generation with CFG (a batch of two per forward): md5-identical latents,
    every site of the transformer on its fast path (the token-major attention in the CFG batch too)."""
    pipe = sd3_pipeline(build_sd3_transformer(seed=12))
    assert_pipeline_generation_exact_and_fused(pipe, dict(**sd3_prompt_embeddings(pipe), guidance_scale=4.0),
                                               every_site=False)  # the last block's context gates never run


def test_unpatch_pickle_and_state_dict():
    model = build_sd3_transformer(seed=5)
    with patch_round_trip(model, sd3_transformer_inputs(model, seed=6)):
        assert type(model.transformer_blocks[1]) is sd3.FastpathJointTransformerBlock
    assert type(model.transformer_blocks[1]) is JointTransformerBlock


def test_compiles_with_fullgraph():
    model = build_sd3_transformer(seed=7)
    assert_compiles_fullgraph_exactly(model, sd3_transformer_inputs(model, seed=8))


@pytest.mark.gpu
@pytest.mark.full_size
@torch.no_grad()
def test_sd35_large_one_step_1024_is_bitwise_identical_and_fused(unpatch_after):
    model = build_sd3_transformer("sd3.5-large", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = sd3_transformer_inputs(model, size=(128, 128), txt_tokens=333, seed=9)  # CLIP 77 + T5 256
        ref = model(**inputs).sample
        assert torch.isfinite(ref).all() and ref.std() > 0.01
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
        blocks = len(model.transformer_blocks)  # 38: every one AdaLayerNormZero, the last context-pre-only
        assert fast_calls(fp.report(model)) == {"layernorm_scale_shift": 4 * blocks - 2,
                                                "gated_residual": 4 * blocks - 2, "rmsnorm": 4 * blocks,
                                                "cat_heads": 3 * blocks, "attention_seq_major": blocks}
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_sd35_large_generation_with_cfg_is_md5_identical():
    """`StableDiffusion3Pipeline` around the SD3.5-large config at 1024x1024, 2 steps with CFG (a batch of two per
    forward, 333 text tokens): the latents md5-identical to unpatched, every site fast on every forward."""
    pipe = sd3_pipeline(build_sd3_transformer("sd3.5-large", torch.bfloat16, "cuda", seed=0))
    try:
        assert_pipeline_generation_exact_and_fused(pipe, dict(**sd3_prompt_embeddings(pipe, tokens=333), height=1024,
                                                              width=1024, num_inference_steps=2, guidance_scale=4.5),
                                                   every_site=False)  # the last block's context gates never run
    finally:
        del pipe
        torch.cuda.empty_cache()
