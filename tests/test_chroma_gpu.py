"""Chroma1-HD at full size on the GPU (published config, random weights): one step at 1024x1024 bit-identical with
every site fused, with a padded prompt's attention mask; a guided multi-step generation md5-identical; CUDA graphs
captured and replayed bit for bit."""

from __future__ import annotations

import hashlib

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.testing import (assert_every_site_fast, build_chroma_transformer, build_flux_vae,
                                        chroma_pipeline, chroma_prompt_embeddings, chroma_transformer_inputs)

pytestmark = [pytest.mark.gpu, pytest.mark.full_size]

# 19 dual blocks (norm1, norm1_context, norm2, norm2_context; four gates) and 38 single blocks (norm; one gate)
CHROMA_SITES = {"layernorm_scale_shift": 19 * 4 + 38, "gated_residual": 19 * 4 + 38, "gelu_cat": 38, "qk_norm_rope": 57,
                "rotary_emb": 57, "linear_cat": 19}
CALLS = {"qk_norm_rope": 2, "rotary_emb": 0}  # per forward: q and k; the pure rotary op only where the norm cannot fuse


@pytest.fixture(scope="module")
def chroma_hd():
    model = build_chroma_transformer("chroma", torch.bfloat16, "cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


@torch.no_grad()
@pytest.mark.parametrize("masked", [0, 200], ids=["unmasked", "padded_prompt"])
def test_chroma_one_step_1024_is_bitwise_identical_and_fully_fused(chroma_hd, masked, unpatch_after):
    inputs = chroma_transformer_inputs(chroma_hd, grid=(64, 64), txt_tokens=512, seed=5, masked=masked)
    ref = chroma_hd(**inputs).sample
    assert torch.isfinite(ref).all() and ref.std() > 0.01
    fp.patch(chroma_hd)
    unpatch_after(chroma_hd)
    out = torch.full_like(ref, float("nan"))
    out.copy_(chroma_hd(**inputs).sample)
    assert torch.equal(out, ref)
    assert_every_site_fast(fp.report(chroma_hd), CHROMA_SITES, CALLS)


@torch.no_grad()
def test_chroma_guided_generation_1024_is_md5_identical(chroma_hd, unpatch_after):
    pipe = chroma_pipeline(chroma_hd, build_flux_vae("flux-dev", torch.bfloat16, "cuda", seed=1))
    pipe.set_progress_bar_config(disable=True)
    emb = chroma_prompt_embeddings(pipe, txt_tokens=512, padding=300, seed=2)

    def generate():
        image = pipe(**emb, height=1024, width=1024, num_inference_steps=4, guidance_scale=4.0, output_type="pt",
                     generator=torch.Generator("cuda").manual_seed(3)).images
        return hashlib.md5(image.float().cpu().numpy().tobytes()).hexdigest()

    ref = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    assert generate() == ref
    assert_every_site_fast(fp.report(pipe.transformer), CHROMA_SITES, CALLS, forwards=8)  # 4 steps, 2 calls each


@torch.no_grad()
def test_chroma_cuda_graphs_capture_and_replay_bitwise(chroma_hd, unpatch_after):
    """``cuda_graphs=True`` captures Chroma's forward (its guidance embedding no longer copies from the host) and
    the replays equal eager for new inputs of the same shapes."""
    cases = [chroma_transformer_inputs(chroma_hd, grid=(64, 64), txt_tokens=512, seed=s, masked=200) for s in (6, 7, 8)]
    refs = [chroma_hd(**inputs).sample for inputs in cases]
    assert not torch.equal(refs[0], refs[1])
    fp.patch(chroma_hd, cuda_graphs=True)
    unpatch_after(chroma_hd)
    for inputs, ref in zip(cases, refs):
        assert torch.equal(chroma_hd(**inputs).sample, ref)
    stats = fp.report(chroma_hd).models[0].graphs
    assert stats["status"] == "on" and stats["captured"] == 1 and stats["replays"] == 2 and stats["eager"] == {}, stats
