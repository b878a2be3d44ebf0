"""FLUX.1 at full size on the GPU: the patched transformer is bit-identical and every modulate site is fused."""

from __future__ import annotations

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs, prompt_embeddings, tiny_flux_pipeline

pytestmark = pytest.mark.gpu


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
    assert len(rep.sites) == 19 * 4 + 38  # every adaLN modulate site of FLUX.1
    assert all(s.fast == 1 and s.fallback == 0 for s in rep.sites), str(rep)
    assert rep.models[0].processors == 19 + 38 and rep.models[0].rope_built == 1


@torch.no_grad()
def test_flux_dev_batch2_odd_resolution_is_bitwise_identical(flux_dev, unpatch_after):
    inputs = flux_transformer_inputs(flux_dev, batch=2, grid=(24, 40), txt_tokens=77, seed=6)  # 384x640, CFG-like
    ref = flux_dev(**inputs).sample
    fp.patch(flux_dev)
    unpatch_after(flux_dev)
    assert torch.equal(flux_dev(**inputs).sample, ref)
    assert all(s.fast == 1 and s.fallback == 0 for s in fp.report(flux_dev).sites)


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
    assert all(s.fast == 28 and s.fallback == 0 for s in rep.sites)


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
    assert code.count("diffusers_fastpath.modulate_scale_shift") == 10, code[:2000]
