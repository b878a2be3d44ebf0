"""``torch.func`` transforms over a patched model run as over the unpatched one (issue 43, item 9): the guards read
``data_ptr()``, which a batched (or grad-tracking) tensor does not have, so the policy refuses every fused op inside
a transform, before any guard, with the reason counted; and a guard that raises (a bug of this package) is a refusal
with one warning, never an exception out of the model.

On a CPU the guards refuse on the device before they read a pointer, so the fast paths' wiring runs with the guards
taking CPU tensors as CUDA ones (`emulated_kernels`), where ed203a0 crashed.
"""

from __future__ import annotations

import functools

import pytest
import torch

import diffusers_fastpath as fp
import diffusers_fastpath.testing as T
from diffusers_fastpath.ops import OPS, Site, gated_residual
from diffusers_fastpath.testing.checks import outputs_equal

REASON_TRANSFORM = "inside a torch.func transform (vmap, grad, jvp)"  # what the sites count there

FAMILIES = {
    "flux": (T.build_flux_transformer, T.flux_transformer_inputs),
    "chroma": (T.build_chroma_transformer, T.chroma_transformer_inputs),
    "flux2": (T.build_flux2_transformer, T.flux2_transformer_inputs),
    "bria-fibo": (functools.partial(T.build_flux_clone, "BriaFiboTransformer2DModel"), T.flux_clone_inputs),
    "sd3": (T.build_sd3_transformer, T.sd3_transformer_inputs),
    "qwenimage": (T.build_qwenimage_transformer, T.qwenimage_transformer_inputs),
    "hunyuan": (T.build_hunyuan_transformer, T.hunyuan_transformer_inputs),
    "hunyuan-video-1.5": (T.build_hunyuan_video15_transformer, T.hunyuan_video15_transformer_inputs),
    "lumina2": (T.build_lumina2_transformer, T.lumina2_transformer_inputs),
    "ltx": (T.build_ltx_transformer, T.ltx_transformer_inputs),
    "wan": (T.build_wan_transformer, T.wan_transformer_inputs),
    "ernie-image": (T.build_ernie_image_transformer, T.ernie_image_inputs),
}  # (Z-Image takes its latents as a list, which vmap does not map over)


def _vmapped(model, inputs: dict, others: dict):
    """``vmap`` of the model over two latents stacked (every other input shared)."""
    latents = torch.stack([inputs["hidden_states"], others["hidden_states"]])
    return torch.func.vmap(lambda h: model(**{**inputs, "hidden_states": h}).sample)(latents)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vmap_over_a_patched_model_is_vmap_over_the_unpatched_one(family, emulated_kernels):
    build, make_inputs = FAMILIES[family]
    model = build(seed=1)
    inputs, others = make_inputs(model, seed=2), make_inputs(model, seed=3)
    with torch.no_grad():
        ref, single = _vmapped(model, inputs, others), model(**inputs).sample
        fp.patch(model)
        try:
            assert outputs_equal(_vmapped(model, inputs, others), ref)
            sites = fp.report(model).sites
            assert any(REASON_TRANSFORM in s.reasons for s in sites)  # refused, and said so
            assert all(s.fast == 0 for s in sites)
            assert all(op.disabled is None for op in OPS.values())
            assert outputs_equal(model(**inputs).sample, single)  # outside the transform: fast and exact again
            assert family == "ernie-image" or any(s.fast for s in fp.report(model).sites)  # (not emulated)
        finally:
            fp.unpatch(model)


def test_vmap_without_the_emulated_guards_too():
    """The plain CPU path (guards refusing the device) under vmap, for one family of each kind of block."""
    for build, make_inputs in (FAMILIES["flux"], FAMILIES["wan"]):
        model = build(seed=4)
        inputs, others = make_inputs(model, seed=5), make_inputs(model, seed=6)
        with torch.no_grad():
            ref = _vmapped(model, inputs, others)
            fp.patch(model)
            try:
                assert outputs_equal(_vmapped(model, inputs, others), ref)
            finally:
                fp.unpatch(model)


def test_grad_through_a_patched_model_is_the_unpatched_grad(emulated_kernels):
    """``torch.func.grad`` wraps tensors for autograd the kernels do not record: refused there too."""
    model = T.build_flux_transformer(dtype=torch.float32, seed=7)
    inputs = T.flux_transformer_inputs(model, seed=8)

    def loss(h):
        return model(**{**inputs, "hidden_states": h}).sample.square().mean()

    ref = torch.func.grad(loss)(inputs["hidden_states"])
    fp.patch(model)
    try:
        assert torch.equal(torch.func.grad(loss)(inputs["hidden_states"]), ref)
    finally:
        fp.unpatch(model)


def test_a_guard_that_raises_is_a_refusal_with_one_warning(monkeypatch, fastpath_log):
    op = OPS["gated_residual"]

    def broken(*args, check_pointers=True):
        raise RuntimeError("a bug in a guard")

    monkeypatch.setattr(op, "guard", broken)
    residual, update, gate = torch.randn(1, 16, 64), torch.randn(1, 16, 64), torch.randn(1, 1, 64)
    site = Site("gated_residual")
    for _ in range(2):
        assert torch.equal(gated_residual(residual, gate, update, site), residual + gate * update)
    assert site.fast == 0 and dict(site.fallback) == {"guard raised RuntimeError": 2}
    assert op.disabled is None
    warnings = [r.message for r in fastpath_log.records if "guard of the fused op 'gated_residual'" in r.message]
    assert len(warnings) == 1 and "a bug in a guard" in warnings[0]


def test_a_batched_tensor_is_refused_before_its_pointer_is_read(emulated_kernels):
    """The guard of every op reads ``data_ptr`` last; inside vmap it is never reached."""
    residual, update, gate = (torch.randn(2, 1, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    site = Site("gated_residual")
    out = torch.func.vmap(lambda r, u, g: gated_residual(r, g[:, :1], u, site))(residual, update, gate)
    assert torch.equal(out, residual + gate[:, :, :1] * update)
    assert dict(site.fallback) == {REASON_TRANSFORM: 1}  # one call of the batched function


def test_the_reason_is_the_policys():
    from diffusers_fastpath.ops._policy import REASON_TRANSFORM as policy_reason

    assert policy_reason == REASON_TRANSFORM


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux", "flux2", "wan", "qwenimage", "ltx"])
def test_gpu_vmap_over_a_patched_model_with_the_real_kernels(family):
    """On the GPU the guards reach ``data_ptr`` (which the emulated ones skip): vmap over the patched model is vmap over
    the unpatched one, and the same model outside vmap still takes its kernels."""
    build, make_inputs = FAMILIES[family]
    model = build(device="cuda", seed=9)
    inputs, others = make_inputs(model, seed=10), make_inputs(model, seed=11)
    with torch.no_grad():
        ref, single = _vmapped(model, inputs, others), model(**inputs).sample
        fp.patch(model)
        try:
            assert outputs_equal(_vmapped(model, inputs, others), ref)
            assert any(REASON_TRANSFORM in s.reasons for s in fp.report(model).sites)
            assert all(op.disabled is None for op in OPS.values())
            assert outputs_equal(model(**inputs).sample, single) and any(s.fast for s in fp.report(model).sites)
        finally:
            fp.unpatch(model)
