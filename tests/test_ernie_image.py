"""ERNIE-Image adapter: exactness, the rotary hoist, self-verification in the model, and the full-size GPU step."""

from __future__ import annotations

import hashlib

import pytest
import torch
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageSharedAdaLNBlock,
    ErnieImageSingleStreamAttnProcessor,
)

import diffusers_fastpath as fp
from diffusers_fastpath.models import ernie_image as ernie_adapter
from diffusers_fastpath._source import source_digest
from diffusers_fastpath.ops import gated_rmsnorm_scale_shift_ref
from diffusers_fastpath.ops.rmsnorm_scale_shift import GATED_RMSNORM_SCALE_SHIFT, RMSNORM_SCALE_SHIFT
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    ernie_image_inputs,
    ernie_image_pipeline,
    ernie_prompt_embeddings,
)


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,lens", [(1, (12,)), (2, (12, 5))])
def test_patched_transformer_matches_unpatched_bitwise(dtype, batch, lens, unpatch_after):
    model = build_ernie_image_transformer(dtype=dtype, seed=batch)
    inputs = ernie_image_inputs(model, batch=batch, grid=(6, 8), text_lens=lens, seed=10 + batch)
    ref = run(model, inputs)
    assert ref.std() > 0.01  # zero-initialised layers were randomised: the output is not trivially zero
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp.patch(model)
    unpatch_after(model)
    for _ in range(2):
        assert torch.equal(run(model, inputs), ref)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    rep = fp.report(model)
    assert [s.op for s in rep.sites] == ["rmsnorm_scale_shift", "gated_rmsnorm_scale_shift"] * 2
    assert all(s.fallback == 2 for s in rep.sites) and rep.models[0].processors == 2


def test_rotary_cos_sin_are_computed_once_not_per_attention_call(monkeypatch, unpatch_after):
    model = build_ernie_image_transformer(seed=3, num_layers=3)
    inputs = ernie_image_inputs(model, batch=2, text_lens=(9, 4), seed=4)
    calls = {"cos": 0}
    real_cos = torch.cos

    def counting_cos(t, *args, **kwargs):
        calls["cos"] += t.dim() == 4  # the rotary angles [B, S, 1, head_dim] (the timestep embedding is 2-D)
        return real_cos(t, *args, **kwargs)

    monkeypatch.setattr(torch, "cos", counting_cos)
    ref = run(model, inputs)
    assert calls["cos"] == 3 * 2  # eager diffusers: q and k of every layer
    fp.patch(model)
    unpatch_after(model)
    calls["cos"] = 0
    for _ in range(4):  # four denoising steps, same positions
        assert torch.equal(run(model, inputs), ref)
    assert calls["cos"] == 4  # once per forward (diffusers builds the angle table once per forward too)
    caches = fp.report(model).models[0].caches
    assert caches == {"rotary_cos_sin": {"built": 4, "reused": 4 * (3 * 2 - 1)}}

    inputs["text_lens"] = torch.tensor([9, 6])  # other text lengths: new positions, and still exact
    ref_model = build_ernie_image_transformer(seed=3, num_layers=3)
    assert torch.equal(run(model, inputs), run(ref_model, inputs))
    assert calls["cos"] == 5 + 3 * 2  # one more build here, plus the unpatched reference's own calls


def test_a_mismatching_kernel_disables_itself_and_the_model_stays_exact(monkeypatch, unpatch_after, fastpath_log):
    """Self-verification inside the model: a kernel that is wrong in the last bit is caught on its first call."""
    model = build_ernie_image_transformer(seed=5)
    inputs = ernie_image_inputs(model, seed=6)
    ref = run(model, inputs)

    def wrong(norm, residual, gate, update, scale, shift, dtype=None):
        res, out = gated_rmsnorm_scale_shift_ref(norm, residual, gate, update, scale, shift, dtype)
        return res, (out.view(torch.int16) ^ 1).view(out.dtype)

    monkeypatch.setattr(GATED_RMSNORM_SCALE_SHIFT, "guard", lambda *a, **k: None)
    monkeypatch.setattr(GATED_RMSNORM_SCALE_SHIFT, "kernel", wrong)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(model, inputs), ref)
    rep = fp.report(model)
    assert rep.ops["gated_rmsnorm_scale_shift"].startswith("disabled (RuntimeError: the fused kernel is not bit-exact")
    assert rep.ops["rmsnorm_scale_shift"].startswith("enabled")
    gated = [s for s in rep.sites if s.op == "gated_rmsnorm_scale_shift"]
    assert all(s.fast == 0 and s.reasons == {"op disabled after an error": 1} for s in gated)
    assert sum("not bit-exact" in r.getMessage() for r in fastpath_log.records) == 1


def test_pipeline_generation_with_cfg_is_identical(unpatch_after):
    pipe = ernie_image_pipeline(build_ernie_image_transformer(seed=7))
    pipe.set_progress_bar_config(disable=True)
    emb = ernie_prompt_embeddings(pipe, lengths=(10, 4))

    def generate():
        out = pipe(**emb, height=128, width=128, num_inference_steps=3, generator=torch.Generator().manual_seed(1),
                   output_type="latent")
        return hashlib.md5(out.images.float().numpy().tobytes()).hexdigest()

    ref = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    assert generate() == ref
    caches = fp.report(pipe).models[0].caches
    assert caches["rotary_cos_sin"]["built"] == 3  # once per forward: 3 steps, CFG batched into one forward


def test_unpatch_restores_the_model(unpatch_after):
    model = build_ernie_image_transformer(seed=8)
    types = [type(m) for m in model.modules()]
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    fp.patch(model)
    unpatch_after(model)
    assert type(model.layers[0]).__name__ == "FastpathErnieImageSharedAdaLNBlock"
    fp.unpatch(model)
    assert [type(m) for m in model.modules()] == types
    assert [m.processor for m in model.modules() if hasattr(m, "processor")] == processors
    assert not [k for m in model.modules() for k in vars(m) if k.startswith("_fastpath")]


def test_patched_model_compiles_with_fullgraph(unpatch_after):
    model = build_ernie_image_transformer(seed=9)
    inputs = ernie_image_inputs(model, batch=2, text_lens=(7, 3), seed=10)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(run(torch.compile(model, fullgraph=True, backend="aot_eager"), inputs), ref)


def test_mirrored_sources_match_the_installed_diffusers():
    assert source_digest(ErnieImageSharedAdaLNBlock.forward) == ernie_adapter._BLOCK_FORWARD
    assert source_digest(ErnieImageSingleStreamAttnProcessor.__call__) == ernie_adapter._PROCESSOR_CALL


# --- GPU: the published model size --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ernie_full():
    model = build_ernie_image_transformer("ernie-image", torch.bfloat16, "cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_ernie_image_one_step_1024_is_bitwise_identical_and_verified(ernie_full, unpatch_after):
    inputs = ernie_image_inputs(ernie_full, grid=(64, 64), text_lens=(120,), seed=11)  # S = 4096 + 120 = 4216
    ref = run(ernie_full, inputs)
    assert torch.isfinite(ref).all() and ref.std() > 0.01
    fp.patch(ernie_full)
    unpatch_after(ernie_full)
    assert torch.equal(run(ernie_full, inputs), ref)
    rep = fp.report(ernie_full)
    assert len(rep.sites) == 2 * 36
    assert all(s.fast == 1 and s.fallback == 0 for s in rep.sites), str(rep)
    for op in (RMSNORM_SCALE_SHIFT, GATED_RMSNORM_SCALE_SHIFT):
        assert op.disabled is None and ("bfloat16", 4096) in op.verified


@pytest.mark.gpu
def test_ernie_image_cfg_generation_1024_is_md5_identical(ernie_full, unpatch_after):
    pipe = ernie_image_pipeline(ernie_full)
    pipe.set_progress_bar_config(disable=True)
    emb = ernie_prompt_embeddings(pipe, lengths=(120, 16), seed=12)

    def generate():
        gen = torch.Generator("cuda").manual_seed(13)
        out = pipe(**emb, height=1024, width=1024, num_inference_steps=8, generator=gen, output_type="latent")
        return hashlib.md5(out.images.float().cpu().numpy().tobytes()).hexdigest()

    ref = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    assert generate() == ref
    rep = fp.report(pipe)
    assert all(s.fast == 8 and s.fallback == 0 for s in rep.sites), str(rep)
    assert rep.models[0].caches["rotary_cos_sin"]["built"] == 8


@pytest.mark.gpu
def test_ernie_image_failed_verification_falls_back_exactly_at_full_size(ernie_full, monkeypatch, unpatch_after):
    """The safety net at the published size: kernels wrong in the last bit are caught on their first call, and
    the step that caught them already returns exactly what eager diffusers returns."""
    inputs = ernie_image_inputs(ernie_full, grid=(64, 64), text_lens=(120,), seed=14)
    ref = run(ernie_full, inputs)
    for op in (RMSNORM_SCALE_SHIFT, GATED_RMSNORM_SCALE_SHIFT):
        real = op.kernel

        def wrong(*args, real=real):
            out = real(*args)
            last = out[-1] if isinstance(out, tuple) else out
            flipped = (last.view(torch.int16) ^ 1).view(last.dtype)
            return (*out[:-1], flipped) if isinstance(out, tuple) else flipped

        monkeypatch.setattr(op, "kernel", wrong)
    fp.patch(ernie_full)
    unpatch_after(ernie_full)
    assert torch.equal(run(ernie_full, inputs), ref)
    assert torch.equal(run(ernie_full, inputs), ref)
    for op in (RMSNORM_SCALE_SHIFT, GATED_RMSNORM_SCALE_SHIFT):
        assert op.disabled is not None and "not bit-exact" in op.disabled
