"""Wan (``WanTransformer3DModel``) through the shared pieces: on CPU exactness (zero-padded prompts, several latent
frames, every dtype), the fused fp32 gated residuals' wiring (kernel emulated), reversibility, pickling, compilation;
on the GPU the Wan 2.1 14B config at 832x480x81 (32,760 tokens)."""

from __future__ import annotations


import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanTransformerBlock

import diffusers_fastpath as fp
from diffusers_fastpath.models import wan
from diffusers_fastpath.testing import (assert_compiles_fullgraph_exactly, assert_patched_equals_unpatched,
                                        assert_patched_step_exact_and_fused, assert_pipeline_generation_exact_and_fused,
                                        build_wan_transformer, patch_round_trip, wan22_pipeline, wan_pipeline,
                                        wan_transformer_inputs)


def sites(blocks: int) -> dict[str, int]:
    # self-attention's and the FFN's (the cross-attention adds no gate, and its norm2 has an affine)
    # and the self-attention's QK norms across all heads with its rotary (one site; the rotary's own is the fallback's)
    return {"gated_residual_fp32": 2 * blocks, "layernorm_scale_shift_fp32": 2 * blocks, "rotary_emb": blocks,
            "qk_norm_rows_rope": blocks, "layernorm_affine_fp32": blocks}  # norm2: its FP32LayerNorm with weight and bias


CALLS = {"qk_norm_rows_rope": 2, "rotary_emb": 0}  # the fused site counts q and k



def test_wan_is_supported():
    assert "WanTransformer3DModel" in fp.supported_classes()
    assert wan._BLOCK.gates_fp32 == ["gate_msa", "c_gate_msa"] and not wan._BLOCK.gates
    assert wan._BLOCK.norms_fp32 == ["norm1", "norm3"] and not wan._BLOCK.norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch, padding", [(1, 0), (2, 3)], ids=["b1", "b2-padded"])
def test_patched_matches_unpatched_bitwise(dtype, batch, padding):
    assert_patched_equals_unpatched(build_wan_transformer, wan_transformer_inputs, sites(2), dtype, batch=batch,
                                    grid=(4, 6), frames=3, txt_tokens=7, padding=padding)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_wan_transformer(seed=3)
    assert_patched_step_exact_and_fused(model, wan_transformer_inputs(model, batch=batch, seed=4), sites(2), CALLS)


def test_wan22_pipeline_patches_both_experts_and_is_identical(emulated_kernels):
    """Wan 2.2 runs two transformers (high-noise steps, then low-noise): `fp.patch(pipe)` patches both, and a 4-step
    generation with CFG (each expert's own guidance scale) is md5-identical, every site of both fast."""
    pipe = wan22_pipeline(build_wan_transformer(seed=13), build_wan_transformer(seed=14))
    fp.patch(pipe)
    assert [m.name for m in fp.report(pipe).models] == ["transformer", "transformer_2"]
    fp.unpatch(pipe)
    gen = torch.Generator().manual_seed(15)
    dim = pipe.transformer.config.text_dim
    pos, neg = (torch.randn(1, 12, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    assert_pipeline_generation_exact_and_fused(pipe, dict(
        prompt_embeds=pos, negative_prompt_embeds=neg, height=32, width=32, num_frames=5, num_inference_steps=4,
        guidance_scale=4.0, guidance_scale_2=3.0), idle=("rotary_emb",))


def test_one_model_as_both_experts_is_one_model_to_patch_and_report(emulated_kernels):
    """Wan 2.2 with one transformer as both experts: `report` lists it once (it listed it twice, and counted its calls
    twice), under both names; `unpatch` restores it."""
    model = build_wan_transformer(seed=13)
    pipe = wan22_pipeline(model, model)
    fp.patch(pipe)
    try:
        assert [m.name for m in fp.report(pipe).models] == ["transformer/transformer_2"]
    finally:
        fp.unpatch(pipe)
    assert type(model.blocks[0]) is WanTransformerBlock


def test_unpatch_pickle_and_state_dict():
    model = build_wan_transformer(seed=5)
    with patch_round_trip(model, wan_transformer_inputs(model, seed=6)):
        assert type(model.blocks[0]) is wan.FastpathWanTransformerBlock
    assert type(model.blocks[0]) is WanTransformerBlock


def test_compiles_with_fullgraph():
    model = build_wan_transformer(seed=7)
    assert_compiles_fullgraph_exactly(model, wan_transformer_inputs(model, seed=8))


@pytest.mark.gpu
@pytest.mark.full_size
def test_wan_14b_one_step_832x480x81_is_bitwise_identical_and_fused():
    """Wan 2.1 T2V 14B's config (28 GiB of bf16 weights) at 832x480x81 (21 latent frames of 30x52 patches: 32,760
    tokens), a prompt zero-padded to 512 tokens: bit-identical, every fp32 gated residual and LayerNorm + modulate
    fused (the latter verified against eager on its first call)."""
    model = build_wan_transformer("wan-14b", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = wan_transformer_inputs(model, grid=(60, 104), frames=21, txt_tokens=512, seed=9, padding=400)
        assert_patched_step_exact_and_fused(model, inputs, sites(40), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_wan_14b_generation_with_cfg_is_md5_identical():
    """`WanPipeline` around the Wan 2.1 14B config at 832x480x81, 2 steps with CFG (a prompt zero-padded to 512
    tokens and its negative, each its own forward): the latents md5-identical to unpatched, every site fast."""
    pipe = wan_pipeline(build_wan_transformer("wan-14b", torch.bfloat16, "cuda", seed=0))
    try:
        gen = torch.Generator().manual_seed(16)
        dim = pipe.transformer.config.text_dim
        pos, neg = (torch.randn(1, 512, dim, generator=gen) for _ in range(2))
        pos[:, 100:] = 0  # the pipeline zero-pads every prompt to 512 tokens
        pos, neg = (t.to("cuda", torch.bfloat16) for t in (pos, neg))
        assert_pipeline_generation_exact_and_fused(pipe, dict(
            prompt_embeds=pos, negative_prompt_embeds=neg, height=480, width=832, num_frames=81, num_inference_steps=2,
            guidance_scale=5.0), idle=("rotary_emb",))
    finally:
        del pipe
        torch.cuda.empty_cache()
