"""HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``) through the shared pieces: on CPU exactness (prompts of
different lengths, several latent frames), the fused paths' wiring (kernels emulated), the pairwise attention mask
built by broadcasting, reversibility, pickling; on the GPU the 480p config at 848x480x33."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_hunyuan_video15 as video15

import diffusers_fastpath as fp
from diffusers_fastpath.models import _chain_calls, hunyuan
from diffusers_fastpath.testing import (assert_patched_equals_unpatched, assert_patched_step_exact_and_fused,
                                        assert_pipeline_generation_exact_and_fused, build_hunyuan_video15_transformer,
                                        hunyuan_video15_pipeline, hunyuan_video15_prompt_embeddings,
                                        hunyuan_video15_transformer_inputs, patch_round_trip)

CALLS = {"rmsnorm_rope_real": 2, "rotary_emb": 0}  # q and k of each block's attention per forward, norm and rotary fused


def sites(blocks: int, refiner: int) -> dict[str, int]:
    """Per dual-stream block norm1, norm1_context, norm2, norm2_context and four gates; two gates per refiner block;
    one rotary site and one QK norm + rotary site per block's attention (the image q and k: two calls; the plain
    rotary, its fallback, none); the text stream's two QK norms, alone."""
    return {"layernorm_scale_shift": 4 * blocks, "gated_residual": 4 * blocks + 2 * refiner, "rotary_emb": blocks,
            "rmsnorm_rope_real": blocks, "rmsnorm": 2 * blocks}


def test_supported_and_what_is_rewritten():
    assert "HunyuanVideo15Transformer3DModel" in fp.supported_classes()
    processor = hunyuan._PROCESSORS[video15.HunyuanVideo15AttnProcessor2_0][1]
    assert processor.rotary == 2 and processor.pairwise_masks == 1
    refiner = hunyuan._VIDEO15_BLOCKS[video15.HunyuanVideo15IndividualTokenRefiner][1]
    assert refiner.pairwise_masks == 1 and not refiner.gates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_matches_unpatched_bitwise(dtype, batch):
    assert_patched_equals_unpatched(build_hunyuan_video15_transformer, hunyuan_video15_transformer_inputs,
                                    sites(2, 1), dtype, seed=2, batch=batch, grid=(4, 6), txt_tokens=9, valid=6,
                                    frames=2)


@pytest.mark.parametrize("batch", [1, 2])
def test_every_site_on_the_fast_path_is_exact(batch, emulated_kernels):
    model = build_hunyuan_video15_transformer(seed=3)
    inputs = hunyuan_video15_transformer_inputs(model, batch=batch, seed=4, frames=3, valid=5)
    assert_patched_step_exact_and_fused(model, inputs, sites(2, 1), CALLS)


def test_a_hooked_qk_norm_runs_as_written_and_says_why(emulated_kernels, unpatch_after):
    """A forward hook on one block's ``norm_k`` runs (the output is the unpatched model's with the same hook); that
    norm and its rotary run as the norm as written + the fused rotary, and the QK norm + rotary site counts why."""
    ref, model = build_hunyuan_video15_transformer(seed=13), build_hunyuan_video15_transformer(seed=13)
    inputs = hunyuan_video15_transformer_inputs(model, seed=14, frames=2, valid=5)
    calls = []
    for m in (ref, model):
        m.transformer_blocks[0].attn.norm_k.register_forward_hook(lambda mod, i, o: calls.append(1) or o * 2)
    with torch.no_grad():
        expected = ref(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, expected) and len(calls) == 2
    rows = {s.site: s for s in fp.report(model).sites}
    fused, rotary = (rows[f"transformer_blocks.0.attn:{op}"] for op in ("rmsnorm_rope_real", "rotary_emb"))
    assert (fused.fast, dict(fused.reasons)) == (1, {"norm has hooks": 1})  # q fused, k as written
    assert (rotary.fast, rotary.fallback) == (1, 0)  # k's rotary, still the fused one


def test_the_pairwise_masks_are_built_by_broadcasting(monkeypatch, unpatch_after):
    """The processor's and the refiner's masks go through `pairwise_mask`: the refiner's once, the processors' padded
    joint mask once per forward (the first block builds it on the rotary table, the second reuses it; a second
    forward builds its own), and the patched forward stays bit-identical."""
    built = []
    real = _chain_calls._ChainsNamespace.pairwise_mask

    def spy(mask, batch, seq):
        out = real(mask, batch, seq)
        built.append(tuple(out.shape))
        return out

    monkeypatch.setattr(_chain_calls._ChainsNamespace, "pairwise_mask", staticmethod(spy))
    model = build_hunyuan_video15_transformer(seed=5)
    inputs = hunyuan_video15_transformer_inputs(model, batch=2, seed=6, txt_tokens=7, valid=4)
    with torch.no_grad():
        ref = model(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        got = model(**inputs).sample
        again = model(**inputs).sample
    assert torch.equal(got, ref) and torch.equal(again, ref)
    image_tokens, text_tokens = 2 * 4 * 4, 7 + 4 + 5  # frames x grid; Qwen text + ByT5 + image embeddings
    assert model.config.num_layers == 2
    assert built == [(2, 1, 7, 7), (2, 1, image_tokens + text_tokens, image_tokens + text_tokens)] * 2


def test_the_padded_mask_is_kept_for_that_mask_at_that_version_and_padding():
    """`pairwise_mask_padded`: reused for the same mask object, version and padding on the same table; computed again
    for another mask of the same values, after a write in place, for another padding, without a table, and with a
    pad function that is not torch's; every result the expression's bits."""
    import torch.nn.functional as F

    ns = _chain_calls._ChainsNamespace
    table = torch.randn(8, 4)

    def expected(mask, padding):
        m = F.pad(mask, padding, value=True).bool()
        seq = m.shape[1]
        m1 = m.view(2, 1, 1, seq).repeat(1, 1, seq, 1)
        return (m1 & m1.transpose(2, 3)).bool()

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    first = ns.pairwise_mask_padded(F.pad, mask, (5, 0), 2, 8, table)
    assert torch.equal(first, expected(mask, (5, 0)))
    # called outside a patched model's forward the table is never sealed (`_rope_cache`): not reused (reused by the
    # later layers of a forward: test_pipeline_generation_with_cfg_is_identical's one build per forward)
    assert ns.pairwise_mask_padded(F.pad, mask, (5, 0), 2, 8, table) is not first
    assert ns.pairwise_mask_padded(F.pad, mask.clone(), (5, 0), 2, 8, table) is not first  # another mask object
    assert ns.pairwise_mask_padded(F.pad, mask, (6, 0), 2, 9, table) is not first  # another padding
    assert ns.pairwise_mask_padded(F.pad, mask, (5, 0), 2, 8, None) is not first  # no table
    spy = []
    own = ns.pairwise_mask_padded(lambda *a, **k: spy.append(1) or F.pad(*a, **k), mask, (5, 0), 2, 8, table)
    assert spy and torch.equal(own, first)  # another pad function: run as written, not cached
    mask[1, 1] = 1  # written in place: its version moves
    again = ns.pairwise_mask_padded(F.pad, mask, (5, 0), 2, 8, table)
    assert again is not first and torch.equal(again, expected(mask, (5, 0)))


def test_pipeline_generation_with_cfg_is_identical(emulated_kernels):
    """`HunyuanVideo15Pipeline` with its CFG guider (a padded prompt and its negative, each its own forward), 3
    steps: md5-identical latents, every site fast (the padded mask built once per forward)."""
    pipe = hunyuan_video15_pipeline(build_hunyuan_video15_transformer(seed=11))
    assert_pipeline_generation_exact_and_fused(pipe, dict(
        hunyuan_video15_prompt_embeddings(pipe, seed=12), height=64, width=64, num_frames=5), idle=("rotary_emb",))


def test_unpatch_pickle_and_state_dict():
    model = build_hunyuan_video15_transformer(seed=7)
    with patch_round_trip(model, hunyuan_video15_transformer_inputs(model, seed=8)):
        assert all(type(b).__module__ == hunyuan.__name__ for b in model.transformer_blocks)
        assert all(type(b.attn.processor).__module__ == hunyuan.__name__ for b in model.transformer_blocks)
        assert type(model.x_embedder) is hunyuan.FastpathHunyuanVideo15PatchEmbed
    assert type(model.x_embedder) is video15.HunyuanVideo15PatchEmbed
    assert all(type(b) is video15.HunyuanVideo15TransformerBlock for b in model.transformer_blocks)


@pytest.mark.gpu
@pytest.mark.full_size
def test_hunyuan_video15_480p_one_step_is_bitwise_identical_and_fused():
    """HunyuanVideo-1.5 480p (8.3B, 16 GiB of bf16 weights) at 848x480x33 (9 latent frames of 30x53: 14,310 image
    tokens; 1,000 Qwen text tokens of which 256 real, 256 masked ByT5, 729 zero image tokens): bit-identical, every
    site fast."""
    model = build_hunyuan_video15_transformer("hunyuanvideo-1.5", torch.bfloat16, "cuda", seed=0)
    try:
        inputs = hunyuan_video15_transformer_inputs(model, grid=(30, 53), frames=9, txt_tokens=1000, valid=256,
                                                    txt2_tokens=256, image_tokens=729, seed=9)
        assert_patched_step_exact_and_fused(model, inputs, sites(54, 2), CALLS)
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.full_size
def test_hunyuan_video15_480p_generation_with_cfg_is_md5_identical():
    """`HunyuanVideo15Pipeline` around the 480p config at 848x480x33, 2 steps with CFG (a 1,000-token prompt, 800
    of them real, its negative, and ByT5 glyph states): the latents md5-identical to unpatched, every site fast."""
    model = build_hunyuan_video15_transformer("hunyuanvideo-1.5", torch.bfloat16, "cuda", seed=0)
    pipe = hunyuan_video15_pipeline(model)
    del model
    try:
        call = hunyuan_video15_prompt_embeddings(pipe, tokens=1000, valid=800, tokens_2=256, valid_2=32, seed=12)
        assert_pipeline_generation_exact_and_fused(pipe, dict(call, height=480, width=848, num_frames=33,
                                                              num_inference_steps=2), idle=("rotary_emb",))
    finally:
        del pipe
        torch.cuda.empty_cache()
