"""Quality tiers on CPU: the mount protocol (enter, exit, nesting, exceptions, two pipelines, re-patching), sites
that cannot take a fusion, `report`, torch.compile, and the "high" numerics with the device check lifted."""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch
import torch.nn.functional as F

import diffusers_fastpath as fp
from diffusers_fastpath.metrics import psnr, ssim
from diffusers_fastpath._state import STATE_ATTR
from diffusers_fastpath.quality import TIER_ATTR, tier_sites
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    build_flux_transformer,
    flux_transformer_inputs,
    prompt_embeddings,
    tiny_flux_pipeline,
)

LG = sys.modules["diffusers_fastpath.ops.linear_gelu"]
# flux-tiny: 2 dual blocks (2 FFN GELUs each) and 2 single blocks (1 MLP each); the adaLN LayerNorms have no
# high-tier site (no approximation of them was faster than the exact fused kernel)
GELU_SITES = 2 * 2 + 2


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def mounted(model):
    return [site.mounted for _, _, site in tier_sites(model)]


def tier(model):
    return vars(model)[STATE_ATTR].quality


@pytest.fixture
def high_on_cpu(monkeypatch):
    """Let the "high" op run on this CPU machine: the epilogue, which CPU torch does not have, is modelled by its
    single rounding (GELU of the fp32 GEMM)."""
    monkeypatch.setattr(LG, "_DEVICE_TYPES", ("cuda", "cpu"))
    emulated = lambda x, w, b: F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh").to(x.dtype)  # noqa: E731
    monkeypatch.setattr(LG.LINEAR_GELU, "kernel", emulated)


def test_sites_are_marked_at_patch_time_and_unmounted_by_default(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=1)
    fp.patch(model)
    unpatch_after(model)
    sites = list(tier_sites(model))
    ops = [site.op for _, _, site in sites]
    assert ops == ["linear_gelu"] * GELU_SITES
    names = {name for name, _, _ in sites}
    assert {"transformer_blocks.0.ff.net.0", "transformer_blocks.1.ff_context.net.0", "single_transformer_blocks.1"} <= names
    assert not any(mounted(model)) and tier(model) == "lossless"
    assert type(model.transformer_blocks[0].ff.net[0]).__name__ == "FastpathGELU"


def test_context_manager_mounts_restores_and_nests(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=2)
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high") as same:
        assert same is model
        assert all(mounted(model)) and tier(model) == "high"
        assert fp.report(model).models[0].quality == "high"
        with fp.quality(model, "lossless"):
            assert not any(mounted(model)) and tier(model) == "lossless"
            with fp.quality(model, "high"):
                assert all(mounted(model))
            assert not any(mounted(model))
        assert all(mounted(model)) and tier(model) == "high"
    assert not any(mounted(model)) and tier(model) == "lossless"
    assert fp.report(model).models[0].quality == "lossless"


def test_an_exception_restores_the_previous_tier(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=3)
    fp.patch(model)
    unpatch_after(model)
    with pytest.raises(RuntimeError, match="inside"):
        with fp.quality(model, "high"):
            with fp.quality(model, "lossless"):
                raise RuntimeError("inside")
    assert not any(mounted(model)) and tier(model) == "lossless"


def test_patch_sets_the_default_tier_and_repatching_changes_it(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=4)
    fp.patch(model, quality="high")
    unpatch_after(model)
    assert all(mounted(model)) and tier(model) == "high"
    with fp.quality(model, "lossless"):
        assert not any(mounted(model))
    assert all(mounted(model))  # back to the default the pipeline was patched with
    state = vars(model)[STATE_ATTR]
    fp.patch(model, quality="lossless")
    assert vars(model)[STATE_ATTR] is state and not any(mounted(model)) and tier(model) == "lossless"
    fp.patch(model, quality="high")
    assert all(mounted(model))


def test_two_pipelines_in_one_process_run_different_tiers(high_on_cpu, unpatch_after):
    a, b = tiny_flux_pipeline(seed=5), tiny_flux_pipeline(seed=5)
    fp.patch(a, quality="high")
    fp.patch(b)
    unpatch_after(a)
    unpatch_after(b)
    assert all(mounted(a.transformer)) and not any(mounted(b.transformer))
    emb = prompt_embeddings(a, txt_tokens=6)
    for pipe in (a, b):
        pipe(**emb, height=32, width=32, num_inference_steps=2, output_type="latent")
    ra, rb = fp.report(a), fp.report(b)
    assert ra.models[0].quality == "high" and rb.models[0].quality == "lossless"
    assert all(s.fast == 2 and s.mounted for s in ra.tier_sites)  # 2 steps, each site on the approximate path
    assert all(s.fast == 0 and s.fallback == 0 and not s.mounted for s in rb.tier_sites)
    with fp.quality(b, "high"):
        assert all(mounted(a.transformer)) and all(mounted(b.transformer))
    assert all(mounted(a.transformer)) and not any(mounted(b.transformer))


def test_outside_the_context_the_output_equals_unpatched(unpatch_after):
    """Inside, on CPU, every site is mounted but its guard sends the call to the lossless path (counted)."""
    model = build_flux_transformer("flux-tiny", seed=6)
    inputs = flux_transformer_inputs(model, seed=7)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high"):
        assert torch.equal(run(model, inputs), ref)
    assert torch.equal(run(model, inputs), ref)
    rep = fp.report(model)
    assert len(rep.tier_sites) == GELU_SITES
    assert all(s.fast == 0 and s.reasons == {"device cpu": 1} for s in rep.tier_sites)


def test_high_tier_with_its_ops_running_stays_close_and_lossless_stays_exact(high_on_cpu, unpatch_after):
    """A 4-step generation with the epilogue (modelled) on every site: close to lossless, and
    not equal to it (the approximate path ran); after the context the image is md5-identical to unpatched."""
    pipe = tiny_flux_pipeline(seed=8)
    emb = prompt_embeddings(pipe, txt_tokens=16, seed=9)

    def generate():
        gen = torch.Generator().manual_seed(0)
        return pipe(**emb, height=128, width=128, num_inference_steps=4, generator=gen, output_type="np").images

    md5 = lambda a: hashlib.md5(a.tobytes()).hexdigest()  # noqa: E731
    unpatched = generate()
    fp.patch(pipe)
    unpatch_after(pipe)
    with fp.quality(pipe, "high"):
        high = generate()
    assert md5(generate()) == md5(unpatched)
    assert not (high == unpatched).all()
    assert psnr(high, unpatched) >= 35 and ssim(high, unpatched) >= 0.97
    rep = fp.report(pipe)
    assert all(s.fast == 4 and s.fallback == 0 for s in rep.tier_sites), str(rep)


def test_sites_that_cannot_take_a_fusion_are_reported(fastpath_log, unpatch_after):
    class QuantLinear(torch.nn.Linear):  # stands for a quantized or LoRA-wrapped layer
        pass

    model = build_flux_transformer("flux-tiny", seed=10)
    inputs = flux_transformer_inputs(model, seed=11)
    ff = model.transformer_blocks[0].ff.net[0]
    ff.proj.__class__ = QuantLinear
    model.single_transformer_blocks[1].proj_mlp.bias = None
    model.transformer_blocks[1].ff_context.net[0].proj.register_forward_hook(lambda *a: None)
    ref = run(model, inputs)
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high"):
        assert torch.equal(run(model, inputs), ref)
        messages = [r.getMessage() for r in fastpath_log.records if "mounted" in r.getMessage()]
        rep = fp.report(model)
    assert len(messages) == 1
    assert f"mounted {GELU_SITES - 3} of {GELU_SITES} sites" in messages[0]
    assert "; 3 cannot (test_quality." in messages[0] and ".QuantLinear is not a plain nn.Linear" in messages[0]
    assert "Linear has no bias: 1" in messages[0] and "has hooks: 1" in messages[0]
    cannot = {s.site: s.cannot for s in rep.tier_sites if s.cannot}
    assert set(cannot) == {"transformer_blocks.0.ff.net.0", "single_transformer_blocks.1", "transformer_blocks.1.ff_context.net.0"}
    assert sum(not s.mounted for s in rep.tier_sites) == 3
    assert any("cannot take their fusion" in n and "no bias" in n for n in rep.models[0].notes)
    assert "cannot: Linear has no bias" in str(fp.report(model, verbose=True))
    assert "  note: 1 high-tier site(s) cannot take their fusion and run the lossless path: Linear has no bias" in str(rep)


def test_a_layer_swapped_in_after_mounting_takes_the_lossless_path(high_on_cpu, unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=12)
    inputs = flux_transformer_inputs(model, seed=13)
    fp.patch(model, quality="high")
    unpatch_after(model)
    ff = model.transformer_blocks[0].ff.net[0]
    wrapped = torch.nn.Sequential()  # not an nn.Linear: what a LoRA adapter's injection looks like to the site
    wrapped.forward = ff.proj.forward
    ff.proj = wrapped
    run(model, inputs)
    counts = {s.site: s.fast for s in fp.report(model).tier_sites}
    assert counts["transformer_blocks.0.ff.net.0"] == 0 and counts["transformer_blocks.0.ff_context.net.0"] == 1


def test_unknown_tier_and_unpatched_objects_are_clear_errors(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=14)
    with pytest.raises(ValueError, match="not patched; call diffusers_fastpath.patch"):
        with fp.quality(model, "high"):
            pass
    fp.patch(model)
    unpatch_after(model)
    with pytest.raises(ValueError, match="unknown quality tier 'ultra'; available: 'lossless', 'high'"):
        with fp.quality(model, "ultra"):
            pass
    with pytest.raises(ValueError, match="unknown quality tier 'medium'"):
        fp.patch(model, quality="medium")
    assert tier(model) == "lossless"


def test_unpatch_inside_the_context_leaves_nothing_behind(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=15)
    inputs = flux_transformer_inputs(model, seed=16)
    ref = run(model, inputs)
    before = [(name, type(m)) for name, m in model.named_modules()]
    fp.patch(model)
    with fp.quality(model, "high"):
        fp.unpatch(model)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert not any(TIER_ATTR in vars(m) or STATE_ATTR in vars(m) for m in model.modules())
    assert torch.equal(run(model, inputs), ref)


def test_mount_logs_one_line_and_a_model_without_sites_says_so(fastpath_log, unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=17)
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high"):
        pass
    lines = [r.getMessage() for r in fastpath_log.records if "quality=high" in r.getMessage()]
    assert lines == [
        "diffusers_fastpath: FluxTransformer2DModel (FluxTransformer2DModel): quality=high: mounted 6 of 6 sites "
        "(linear_gelu 6/6)"
    ]
    assert any("unmounted 6 sites" in r.getMessage() for r in fastpath_log.records)

    ernie = build_ernie_image_transformer("ernie-image-tiny", seed=0)
    fp.patch(ernie, quality="high")
    unpatch_after(ernie)
    assert any("has no high-tier fusion sites; it runs the lossless path" in r.getMessage() for r in fastpath_log.records)
    assert fp.report(ernie).models[0].quality == "high" and fp.report(ernie).tier_sites == []


def test_report_plain_data_has_the_tier_sites(unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=18)
    fp.patch(model, quality="high")
    unpatch_after(model)
    run(model, flux_transformer_inputs(model, seed=19))
    data = fp.report(model).to_dict()
    assert data["models"][0]["quality"] == "high"
    row = next(r for r in data["tier_sites"] if r["site"] == "transformer_blocks.0.ff.net.0")
    assert row == dict(model="FluxTransformer2DModel", site="transformer_blocks.0.ff.net.0", module="FastpathGELU",
                       op="linear_gelu", fast=0, fallback=1, reasons={"device cpu": 1}, mounted=True, cannot=None)
    assert all(r["mounted"] is None for r in data["sites"])  # the lossless sites carry no tier


def test_compiled_model_with_high_mounted_traces_fullgraph(high_on_cpu, unpatch_after):
    model = build_flux_transformer("flux-tiny", seed=20)
    inputs = flux_transformer_inputs(model, seed=21)
    fp.patch(model)
    unpatch_after(model)
    with fp.quality(model, "high"):
        eager_high = run(model, inputs)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with fp.quality(model, "high"):
        out = run(compiled, inputs)
    code = graphs[-1].code
    assert code.count("diffusers_fastpath.linear_gelu") == GELU_SITES
    # The epilogue's custom op runs eager off CUDA (the modelled kernel is the eager op's), so compare loosely.
    torch.testing.assert_close(out, eager_high, atol=0.0625, rtol=0.05)
    lossless = run(compiled, inputs)  # unmounted: recompiled without the approximate ops
    assert "linear_gelu" not in graphs[-1].code
    assert torch.equal(lossless, run(build_flux_transformer("flux-tiny", seed=20), inputs))
