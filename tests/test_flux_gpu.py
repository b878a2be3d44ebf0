"""FLUX.1 at full size on the GPU: the patched transformer is bit-identical and every fusion site is fused."""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs, prompt_embeddings, tiny_flux_pipeline

pytestmark = pytest.mark.gpu

# The one site that cannot avoid its copy: the first single block concatenates the dual blocks' two outputs.
def assert_all_fast(rep, calls=1):
    """Every site of FLUX.1 (19 dual + 38 single blocks: 8 and 4 sites each, but the first single block's token
    concatenation, whose inputs are always two tensors, is no site) took its fast path `calls` times."""
    assert len(rep.sites) == 19 * 8 + 38 * 4 - 1, str(rep)
    for s in rep.sites:
        assert s.fast == calls and s.fallback == 0, str(rep)
    ops = {}
    for s in rep.sites:
        ops[s.op] = ops.get(s.op, 0) + 1
    assert ops == {"layernorm_scale_shift": 114, "gated_residual": 114, "joint_tokens_view": 37, "concat_in_place": 38}


@pytest.fixture(scope="module")
def flux_dev():
    model = build_flux_transformer("flux-dev", torch.bfloat16, "cuda", seed=0)
    yield model
    del model
    torch.cuda.empty_cache()


@torch.no_grad()
def test_flux_dev_one_step_1024_is_bitwise_identical(flux_dev, unpatch_after):
    inputs = flux_transformer_inputs(flux_dev, grid=(64, 64), txt_tokens=512, seed=5)  # 1024x1024
    ref = flux_dev(**inputs).sample
    assert torch.isfinite(ref).all() and ref.abs().max() > 0 and ref.std() > 0.01

    fp.patch(flux_dev)
    unpatch_after(flux_dev)
    out = flux_dev(**inputs).sample
    assert torch.equal(out, ref)

    rep = fp.report(flux_dev)
    assert_all_fast(rep)
    assert rep.models[0].processors == 19 + 38 and rep.models[0].rope_built == 1


@torch.no_grad()
def test_flux_dev_batch2_odd_resolution_is_bitwise_identical(flux_dev, unpatch_after):
    inputs = flux_transformer_inputs(flux_dev, batch=2, grid=(24, 40), txt_tokens=77, seed=6)  # 384x640, CFG-like
    ref = flux_dev(**inputs).sample
    fp.patch(flux_dev)
    unpatch_after(flux_dev)
    assert torch.equal(flux_dev(**inputs).sample, ref)
    assert_all_fast(fp.report(flux_dev))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_pipeline_generation_is_md5_identical_on_cuda(dtype, unpatch_after):
    import hashlib

    pipe = tiny_flux_pipeline(dtype=dtype, device="cuda", seed=3)
    emb = prompt_embeddings(pipe, txt_tokens=16)

    def generate():
        gen = torch.Generator("cuda").manual_seed(0)
        out = pipe(**emb, height=128, width=128, num_inference_steps=4, generator=gen, output_type="np")
        return hashlib.md5(out.images.tobytes()).hexdigest()

    ref = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    assert generate() == ref
    rep = fp.report(pipe)
    assert rep.fast > 0 and rep.fallback == 0, str(rep)


@torch.no_grad()
def test_flux_dev_pipeline_28_steps_1024_is_md5_identical(flux_dev, unpatch_after):
    """A whole generation: 28 denoising steps at 1024x1024 and the VAE decode, image md5 equal to unpatched."""
    import hashlib

    pipe = tiny_flux_pipeline(transformer=flux_dev, device="cuda", seed=7)
    pipe.set_progress_bar_config(disable=True)
    emb = prompt_embeddings(pipe, txt_tokens=512, seed=8)

    def generate():
        gen = torch.Generator("cuda").manual_seed(9)
        out = pipe(**emb, height=1024, width=1024, num_inference_steps=28, generator=gen, output_type="np")
        return hashlib.md5(out.images.tobytes()).hexdigest(), out.images

    ref_md5, ref = generate()
    assert ref.std() > 0.01
    fp.patch(pipe)
    unpatch_after(pipe)
    md5, _ = generate()
    assert md5 == ref_md5
    rep = fp.report(pipe)
    assert rep.models[0].rope_built == 1 and rep.models[0].rope_reused == 27
    assert_all_fast(rep, calls=28)


def test_patched_model_under_compile_runs_the_custom_op_exactly(unpatch_after):
    """fullgraph torch.compile of the patched model on CUDA: the fused sites are the registered custom op, and
    with a backend that keeps aten's kernels (aot_eager) the output stays bit-identical to unpatched eager."""
    model = build_flux_transformer("flux-tiny", torch.bfloat16, "cuda", seed=31)
    inputs = flux_transformer_inputs(model, batch=2, grid=(8, 8), txt_tokens=16, seed=32)
    with torch.no_grad():
        ref = model(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

        out = torch.compile(model, fullgraph=True, backend=backend)(**inputs).sample
    assert torch.equal(out, ref)
    code = graphs[0].code
    # unverified LayerNorm signature under compile: the reference, LayerNorm + the fused modulate, is traced
    assert code.count("diffusers_fastpath.modulate_scale_shift") == 10, code[:2000]
    assert code.count("diffusers_fastpath.gated_residual") == 2 * 4 + 2, code[:2000]


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flux_dev_sized_blocks_are_bitwise_identical_in_both_dtypes(dtype, unpatch_after):
    """FLUX.1-dev widths (3072, 24 x 128 heads, MLP 12288) with one dual and three single blocks, in bf16 and fp16
    (fp16 adds the clip after each block), batch 2 and odd token counts: patched == unpatched, every site fast
    (the second and third single blocks take the previous block's output as their joint tokens)."""
    model = build_flux_transformer("flux-dev", dtype, "cuda", seed=11, num_layers=1, num_single_layers=3)
    inputs = flux_transformer_inputs(model, batch=2, grid=(31, 33), txt_tokens=97, seed=12)  # 1023 image tokens
    ref = model(**inputs).sample
    assert torch.isfinite(ref).all() and ref.std() > 0.01
    fp.patch(model)
    unpatch_after(model)
    assert torch.equal(model(**inputs).sample, ref)
    rep = fp.report(model)
    assert len(rep.sites) == 8 + 3 * 4 - 1
    for s in rep.sites:
        assert s.fast == 1 and s.fallback == 0, str(rep)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch,tokens", [(1, 4608), (2, 4608), (1, 4097)])
def test_gelu_into_the_concat_buffer_matches_cat_on_cuda(dtype, batch, tokens):
    """The single block's ``cat([attn_output, gelu_tanh(proj_mlp)], dim=2)`` at FLUX.1-dev width (3072 + 12288):
    aten's GELU written into the right-hand columns of a NaN-poisoned buffer, then the attention output copied into
    the left ones, equals the cat bit for bit; the GELU writes through the view (no temporary, no copy)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator("cuda").manual_seed(tokens + batch)
    attn = torch.randn(batch, tokens, 3072, generator=gen, device="cuda").to(dtype)
    proj = (torch.randn(batch, tokens, 12288, generator=gen, device="cuda") * 3).to(dtype)
    ref = torch.cat([attn, torch.nn.GELU(approximate="tanh")(proj)], dim=2)
    buffer = torch.full((batch, tokens, 3072 + 12288), float("nan"), dtype=dtype, device="cuda")
    view = buffer[:, :, 3072:]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = torch._C._nn.gelu(proj, approximate="tanh", out=view)
    assert got is view
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == ["aten::gelu"]
    buffer[:, :, :3072].copy_(attn)
    assert torch.equal(buffer, ref)
