"""A fused op that stands for a module's call (a LayerNorm or RMSNorm whose weight and eps its kernel reads, a SiLU or
GELU it computes itself) runs that module's hooks or refuses (issue 43, items 1 and 2): its own forward hooks and
pre-hooks, a ``forward`` replaced on the instance, and the global module hooks of
``torch.nn.modules.module.register_module_forward_hook`` / ``..._pre_hook``. Refused, the eager expression calls the
module, so the hooks run exactly as unpatched, once per call; the reason is counted on the site; a hook present on
the very first call disables nothing (the policy refuses before any self-check).

On a CPU the ops' guards take the tensors as CUDA ones (`emulated_kernels`) and each op that stands for a module call
runs, as its kernel, its registered custom op: computed from the module's parameters without calling it, as the CUDA
kernels are (`module_free_kernels`). The real kernels on the GPU: the ``gpu`` tests at the end.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.nn.modules import module as nn_module

import diffusers_fastpath as fp
from diffusers_fastpath.ops import OPS
from diffusers_fastpath.quality import hooked, tier_sites
from diffusers_fastpath.testing import (build_ernie_image_transformer, build_flux2_transformer, build_flux_clone,
                                        build_flux_transformer, build_hunyuan_video15_transformer,
                                        build_lumina2_transformer, build_ltx_transformer, build_qwenimage_transformer,
                                        build_sd3_transformer, build_wan_transformer, build_zimage_transformer,
                                        ernie_image_inputs, flux2_transformer_inputs, flux_clone_inputs,
                                        flux_transformer_inputs, hunyuan_video15_transformer_inputs,
                                        lumina2_transformer_inputs, ltx_transformer_inputs,
                                        qwenimage_transformer_inputs, sd3_transformer_inputs, wan_transformer_inputs,
                                        zimage_transformer_inputs)
from diffusers_fastpath.testing.checks import outputs_equal

# the fused ops that stand for a module's call (its first argument, the QK pairs' also their third/fourth)
MODULE_OPS = ("layernorm_scale_shift", "gated_layernorm_scale_shift", "layernorm_scale_shift_fp32",
              "layernorm_affine_fp32", "rmsnorm_scale_shift", "gated_rmsnorm_scale_shift", "rmsnorm_scale",
              "rmsnorm_gated_residual", "rmsnorm_modulate", "rmsnorm_rope_complex", "rmsnorm_rope_complex_cat",
              "rmsnorm_rope_complex_prefix", "rmsnorm_rope_real", "qk_norm_rope", "qk_norm_rows_rope",
              "qk_norm_rows_rope_pair", "layernorm_modulate", "layernorm_scale")


def _as_if_on_cuda(guard):
    def on_cpu(*args, check_pointers=True):
        reason = guard(*args, check_pointers=False)
        return None if reason == "device cpu" else reason
    return on_cpu


@pytest.fixture
def module_free_kernels(emulated_kernels, monkeypatch):
    """`emulated_kernels`, and each op that stands for a module call computes its result from the module's weight and
    eps without calling the module (its registered custom op, whose CPU path is the eager formula of those tensors),
    as its CUDA kernel does: a hook the policy let through would be skipped here as on the GPU."""
    for name in MODULE_OPS:
        op = OPS[name]
        if name in ("rmsnorm_scale_shift", "gated_rmsnorm_scale_shift"):  # not in `emulated_kernels`
            monkeypatch.setattr(op, "guard", _as_if_on_cuda(op.guard))
        monkeypatch.setattr(op, "kernel", op.custom_op)


def _flux(**kw):
    return build_flux_transformer(**kw)


# (builder, inputs, the module's path, the op of a site that takes it fast when it has no hooks)
CASES = {
    "flux-dual-norm2": (_flux, flux_transformer_inputs, "transformer_blocks.0.norm2", "gated_layernorm_scale_shift"),
    "flux-adaln-norm": (_flux, flux_transformer_inputs, "transformer_blocks.0.norm1.norm", "layernorm_scale_shift"),
    "flux-single-adaln-norm": (_flux, flux_transformer_inputs, "single_transformer_blocks.1.norm.norm",
                               "gated_layernorm_scale_shift"),  # the hand-off from single block 0
    "flux-qk-norm": (_flux, flux_transformer_inputs, "transformer_blocks.0.attn.norm_q", "qk_norm_rope"),
    "flux-gelu": (_flux, flux_transformer_inputs, "single_transformer_blocks.0.act_mlp", "gelu_cat"),
    "flux2-norm1": (build_flux2_transformer, flux2_transformer_inputs, "transformer_blocks.0.norm1",
                    "layernorm_scale_shift"),
    "flux2-swiglu-silu": (build_flux2_transformer, flux2_transformer_inputs, "transformer_blocks.0.ff.act_fn.gate_fn",
                          "silu_mul"),
    "flux2-swiglu-cat-silu": (build_flux2_transformer, flux2_transformer_inputs,
                              "single_transformer_blocks.0.attn.mlp_act_fn.gate_fn", "swiglu_cat"),
    "sd3-norm2": (build_sd3_transformer, sd3_transformer_inputs, "transformer_blocks.0.norm2", "layernorm_scale_shift"),
    "fibo-rms-rope-real": (functools.partial(build_flux_clone, "BriaFiboTransformer2DModel"), flux_clone_inputs,
                           "single_transformer_blocks.0.attn.norm_q", "rmsnorm_rope_real"),
    "hunyuan15-rms-rope-real": (build_hunyuan_video15_transformer, hunyuan_video15_transformer_inputs,
                                "transformer_blocks.0.attn.norm_k", "rmsnorm_rope_real"),
    "qwen-rms-rope-cat": (build_qwenimage_transformer, qwenimage_transformer_inputs,
                          "transformer_blocks.0.attn.norm_added_q", "rmsnorm_rope_complex_cat"),
    "zimage-rms-scale": (build_zimage_transformer, zimage_transformer_inputs, "layers.0.attention_norm1",
                         "rmsnorm_scale"),
    "zimage-rms-gated": (build_zimage_transformer, zimage_transformer_inputs, "layers.0.ffn_norm2",
                         "rmsnorm_gated_residual"),
    "zimage-rms-rope": (build_zimage_transformer, zimage_transformer_inputs, "layers.0.attention.norm_q",
                        "rmsnorm_rope_complex"),
    "lumina2-fp32silu": (build_lumina2_transformer, lumina2_transformer_inputs, "layers.0.feed_forward.silu",
                         "silu_mul"),
    "ltx-rms-modulate": (build_ltx_transformer, ltx_transformer_inputs, "transformer_blocks.0.norm1",
                         "rmsnorm_modulate"),
    "ltx-qk-rows-pair": (build_ltx_transformer, ltx_transformer_inputs, "transformer_blocks.0.attn1.norm_k",
                         "qk_norm_rows_rope_pair"),
    "wan-norm1-fp32": (build_wan_transformer, wan_transformer_inputs, "blocks.0.norm1", "layernorm_scale_shift_fp32"),
    "wan-norm2-affine": (build_wan_transformer, wan_transformer_inputs, "blocks.0.norm2", "layernorm_affine_fp32"),
    "wan-qk-rows": (build_wan_transformer, wan_transformer_inputs, "blocks.0.attn1.norm_q", "qk_norm_rows_rope"),
    "ernie-sa-ln": (build_ernie_image_transformer, ernie_image_inputs, "layers.0.adaLN_sa_ln", "rmsnorm_scale_shift"),
    "ernie-mlp-ln": (build_ernie_image_transformer, ernie_image_inputs, "layers.0.adaLN_mlp_ln",
                     "gated_rmsnorm_scale_shift"),
}


class _Undo:
    def __init__(self, remove) -> None:
        self.remove = remove


@contextlib.contextmanager
def _hook(kind: str, target: torch.nn.Module, calls: list):
    """A hook of `kind` on `target` that changes its output (or input) and counts its calls in `calls`."""
    handles = []
    if kind == "forward":
        handles.append(target.register_forward_hook(lambda m, args, out: calls.append(1) or out * 1.5))
    elif kind == "pre":
        # a norm's output does not change with a scaled or shifted input: a pre-hook that bends it does
        handles.append(target.register_forward_pre_hook(lambda m, args: calls.append(1) or (torch.tanh(args[0]),)))
    elif kind == "forward-on-instance":  # accelerate's and diffusers' hooks replace ``forward`` on the instance
        original = target.forward

        def forward(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs) * 1.5

        target.forward = forward
    elif kind == "forward-on-class":  # a library replaced torch's or diffusers' forward on the class (after `patch`)
        owner = next(c for c in type(target).__mro__
                     if "forward" in c.__dict__ and not c.__module__.startswith("diffusers_fastpath"))
        original_forward = owner.__dict__["forward"]

        def replaced(self, *args, **kwargs):
            if self is target:
                calls.append(1)
                return original_forward(self, *args, **kwargs) * 1.5
            return original_forward(self, *args, **kwargs)

        owner.forward = replaced
        handles.append(_Undo(lambda: setattr(owner, "forward", original_forward)))
    elif kind == "global":
        handles.append(nn_module.register_module_forward_hook(
            lambda m, args, out: (calls.append(1) or out * 1.5) if m is target else None))
    elif kind == "global-pre":
        handles.append(nn_module.register_module_forward_pre_hook(
            lambda m, args: (calls.append(1) or (torch.tanh(args[0]),)) if m is target else None))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        target.__dict__.pop("forward", None)


def _sites(model, op: str, path: str):
    """The report's sites of `op` (any, None) on the module at `path` or its parents (a QK norm's site is its
    attention's)."""
    return [s for s in fp.report(model).sites if op in (None, s.op) and path.startswith(s.site.split(":")[0])]


def _check(case: str, kind: str, dtype=torch.bfloat16) -> None:
    build, make_inputs, path, op = CASES[case]
    ref_model, model = build(dtype=dtype, seed=1), build(dtype=dtype, seed=1)
    inputs = make_inputs(model, seed=2)
    ref_calls, calls = [], []
    with torch.no_grad():
        plain = ref_model(**inputs).sample
        with _hook(kind, ref_model.get_submodule(path), ref_calls):
            ref = ref_model(**inputs).sample
        assert ref_calls and not outputs_equal(ref, plain)  # the hook runs and changes the output: the test can fail
        fp.patch(model)
        try:
            target = model.get_submodule(path)
            with _hook(kind, target, calls):
                assert hooked(target)
                got = model(**inputs).sample
            assert outputs_equal(got, ref) and len(calls) == len(ref_calls)  # every hook call, and no more
            sites = _sites(model, op, path)
            fast_hooked = sum(s.fast for s in sites)
            # the reason, on that site or (Qwen-Image's joint form, which hands a refused stream to the single op)
            # on another of the module's
            assert any("hooks" in reason or "replaced on its class" in reason
                       for s in _sites(model, None, path) for reason in s.reasons), fp.report(model)
            assert OPS[op].disabled is None  # a hook on the first call disables nothing
            assert outputs_equal(model(**inputs).sample, plain)  # the hook gone: the fast path, unchanged numbers
            fast_free = sum(s.fast for s in _sites(model, op, path)) - fast_hooked
            assert fast_hooked < fast_free, fp.report(model)  # (a QK site counts q and k: the other norm stays fast)
        finally:
            fp.unpatch(model)


@pytest.mark.parametrize("case", list(CASES))
def test_a_forward_hook_on_a_fused_module_runs_as_unpatched(case, module_free_kernels):
    _check(case, "forward")


@pytest.mark.parametrize("kind", ["pre", "forward-on-instance", "global", "global-pre"])
@pytest.mark.parametrize("case", ["flux-dual-norm2", "flux-adaln-norm", "flux-gelu", "wan-norm1-fp32",
                                  "ernie-sa-ln", "lumina2-fp32silu", "zimage-rms-rope"])
def test_every_kind_of_hook_runs_as_unpatched(case, kind, module_free_kernels):
    _check(case, kind)


@pytest.mark.parametrize("case", list(CASES))
def test_a_forward_replaced_on_the_class_runs_as_unpatched(case, module_free_kernels):
    """``nn.LayerNorm.forward`` (or diffusers' ``RMSNorm.forward``, ``GELU.forward``, ...) replaced on the class by
    another library: a fused op that stands for the module's call refuses (`_policy.forward_replaced`), and this
    package's subclasses of those classes run the replacement (`_state.bound_safe`); put back, the fast path
    returns."""
    _check(case, "forward-on-class")


def test_forward_replaced_knows_written_forwards_from_replacements(monkeypatch):
    import functools

    from diffusers.models.normalization import RMSNorm

    from diffusers_fastpath.models._qk_norms import FastpathRMSNorm
    from diffusers_fastpath.ops._policy import forward_replaced

    norm, rms = torch.nn.LayerNorm(8), FastpathRMSNorm(8, eps=1e-6)
    assert not forward_replaced(norm) and not forward_replaced(rms)
    original = torch.nn.LayerNorm.forward
    monkeypatch.setattr(torch.nn.LayerNorm, "forward", functools.wraps(original)(lambda self, x: original(self, x)))
    assert forward_replaced(norm)  # a wrapper keeps the name, not the code's file
    monkeypatch.undo()
    assert not forward_replaced(norm)
    rms_forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: rms_forward(self, x))
    assert forward_replaced(rms)  # a parent of this package's class
    monkeypatch.undo()
    assert not forward_replaced(rms)


def test_forward_replaced_reads_traced_fx_and_decorated_forwards():
    """A ``torch.jit.trace``'d module (its class's ``forward`` is a descriptor that raises) counts as replaced without
    raising; a ``torch.fx.GraphModule``'s generated forward and diffusers' decorated ones (``apply_lora_scale``) are
    their classes' own."""
    from diffusers_fastpath.ops._policy import forward_replaced

    assert forward_replaced(torch.jit.trace(torch.nn.Linear(4, 4), torch.randn(1, 4)))
    assert not hooked(torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4))))
    assert not forward_replaced(_flux(seed=1))


def _ffn_replaced(model, how: str):
    """Each dual block's ``ff_context`` as a traced module or an fx graph of its layers (the same numbers)."""
    for block in model.transformer_blocks:
        if how == "jit":
            x = torch.randn(1, 8, block.ff_context.net[0].proj.in_features, dtype=torch.bfloat16)
            with torch.no_grad():
                block.ff_context = torch.jit.trace(block.ff_context, x)
        else:
            class Leaves(torch.fx.Tracer):
                def is_leaf_module(self, m, qualname):
                    return not isinstance(m, torch.nn.Sequential)

            seq = torch.nn.Sequential(*block.ff_context.net)
            block.ff_context = torch.fx.GraphModule(seq, Leaves().trace(seq))
    return model


@pytest.mark.parametrize("how", ["jit", "fx"])
def test_a_traced_or_fx_submodule_between_blocks_keeps_the_hand_offs(how, module_free_kernels):
    """A module the hand-off passes by (the dual block's text FFN, run between the update and the next block) is called
    as it is, so only its hooks matter there: a traced one no longer crashes the check (27b1138's `forward_replaced`
    read its class's ``forward`` through torch's raising descriptor) and an fx graph no longer refuses it."""
    plain, ref_model, model = _flux(seed=3), _ffn_replaced(_flux(seed=3), how), _ffn_replaced(_flux(seed=3), how)
    inputs = flux_transformer_inputs(model, seed=4)

    def fast_sites(m):
        fp.patch(m)
        try:
            with torch.no_grad():
                out = m(**inputs).sample
            sites = fp.report(m).sites
            return out, {(s.site, s.op): s.fast for s in sites}, {r for s in sites for r in s.reasons if "hooks" in r}
        finally:
            fp.unpatch(m)

    with torch.no_grad():
        ref = ref_model(**inputs).sample
    got, fast, hooks = fast_sites(model)
    assert outputs_equal(got, ref) and not hooks
    assert fast == fast_sites(plain)[1]


def test_a_parent_forward_the_class_shadows_does_not_refuse(module_free_kernels, monkeypatch):
    """``nn.LayerNorm.forward`` replaced on torch's class: diffusers' ``FP32LayerNorm`` has its own forward, which
    never calls it, so Wan's FP32LayerNorm sites stay fast (and equal to unpatched with the same replacement)."""
    ref_model, model = build_wan_transformer(seed=1), build_wan_transformer(seed=1)
    inputs = wan_transformer_inputs(model, seed=2)
    original = torch.nn.LayerNorm.forward
    monkeypatch.setattr(torch.nn.LayerNorm, "forward", lambda self, x: original(self, x) * 1.5)
    with torch.no_grad():
        ref = ref_model(**inputs).sample
        fp.patch(model)
        try:
            assert outputs_equal(model(**inputs).sample, ref)
            sites = [s for s in fp.report(model).sites if s.op in ("layernorm_scale_shift_fp32", "layernorm_affine_fp32")]
            assert sites and all(s.fast > 0 for s in sites), [(s.site, s.fast, s.reasons) for s in sites]
        finally:
            fp.unpatch(model)


def test_a_hook_added_after_the_op_verified_still_runs(module_free_kernels):
    """The issue's first case: the op verified for this dtype and width on a hook-free call, then a hook on FLUX.1's
    ``transformer_blocks[0].norm2`` (an adaLN's ``.norm`` on the other stream): both run on every later call."""
    ref_model, model = _flux(seed=3), _flux(seed=3)
    inputs = flux_transformer_inputs(model, seed=4)
    paths = ("transformer_blocks.0.norm2", "transformer_blocks.0.norm1_context.norm")
    with torch.no_grad():
        fp.patch(model)
        try:
            model(**inputs)
            assert ("bfloat16", model.config.num_attention_heads * model.config.attention_head_dim) in \
                OPS["layernorm_scale_shift"].verified
            ref_calls, calls = [], []
            with contextlib.ExitStack() as stack:
                for path in paths:
                    stack.enter_context(_hook("forward", ref_model.get_submodule(path), ref_calls))
                    stack.enter_context(_hook("forward", model.get_submodule(path), calls))
                for _ in range(2):
                    assert outputs_equal(model(**inputs).sample, ref_model(**inputs).sample)
                assert len(calls) == len(ref_calls) == 4
        finally:
            fp.unpatch(model)


def test_the_high_tier_gemm_epilogue_runs_no_linear_whose_hooks_came_after_mounting():
    """FLUX.1's ``"high"`` tier runs an FFN up-projection and its GELU as one GEMM (`linear_gelu`), mounted where the
    Linear had no hooks; a global hook registered afterwards is asked about per call, so every Linear runs as
    written and the hook sees each call once."""
    ref_model, model = _flux(seed=9), _flux(seed=9)
    inputs = flux_transformer_inputs(model, seed=10)
    counted = []

    def count_linears(module, args, out):
        if isinstance(module, torch.nn.Linear):
            counted.append(module)

    with torch.no_grad():
        handle = nn_module.register_module_forward_hook(count_linears)
        try:
            ref, ref_calls = ref_model(**inputs).sample, len(counted)
        finally:
            handle.remove()
        fp.patch(model)
        try:
            with fp.quality(model, "high"):
                assert any(site.mounted for _, _, site in tier_sites(model))
                counted.clear()
                handle = nn_module.register_module_forward_hook(count_linears)
                try:
                    got = model(**inputs).sample
                finally:
                    handle.remove()
                assert len(counted) == ref_calls and outputs_equal(got, ref)
                assert all(site.counters.fast == 0 for _, _, site in tier_sites(model))
        finally:
            fp.unpatch(model)


def test_hooked_sees_global_hooks_and_forgets_them_when_removed():
    norm = torch.nn.LayerNorm(8)
    assert not hooked(norm)
    for register in (nn_module.register_module_forward_hook, nn_module.register_module_forward_pre_hook):
        handle = register(lambda *args: None)
        try:
            assert hooked(norm)
        finally:
            handle.remove()
        assert not hooked(norm)
    norm.forward = norm.forward  # a forward on the instance (accelerate, diffusers' hooks)
    assert hooked(norm)


def test_verification_runs_no_hook_twice(module_free_kernels):
    """The self-check's eager reference calls the module: it runs only where the module has no hooks (the policy
    refuses before it), so a hook that counts its calls sees each call once, verification or not."""
    from diffusers_fastpath.ops import layernorm_scale_shift

    norm = torch.nn.LayerNorm(64, elementwise_affine=False)
    x, emb = torch.randn(1, 16, 64, dtype=torch.bfloat16), torch.randn(1, 6 * 64, dtype=torch.bfloat16)
    shift, scale = emb.chunk(6, dim=1)[:2]
    calls = []
    with _hook("forward", norm, calls):
        out = layernorm_scale_shift(norm, x, scale, shift)
    assert len(calls) == 1 and not OPS["layernorm_scale_shift"].verified
    with _hook("forward", norm, []):
        expected = norm(x) * (1 + scale[:, None]) + shift[:, None]
    assert torch.equal(out, expected)


# --- on the GPU: the real kernels --------------------------------------------------------------------------------


def _gpu_flux(seed):
    # D = 256 (a width every LayerNorm kernel takes), two dual and two single blocks
    return build_flux_transformer(device="cuda", seed=seed, num_attention_heads=4, attention_head_dim=64,
                                  axes_dims_rope=(16, 24, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["forward", "pre", "forward-on-instance", "global"])
@pytest.mark.parametrize("path", ["transformer_blocks.0.norm2", "transformer_blocks.0.norm1.norm",
                                  "single_transformer_blocks.1.norm.norm", "transformer_blocks.0.attn.norm_q"])
def test_gpu_a_hook_on_a_norm_runs_with_the_real_kernels(path, kind):
    """FLUX.1 on the GPU, the real kernels: a hook on a norm present from the first call (nothing disabled, nothing
    verified against a hooked reference) and one added after the ops verified both give unpatched diffusers' bits,
    every hook call once."""
    ref_model, model = _gpu_flux(5), _gpu_flux(5)
    inputs = flux_transformer_inputs(model, seed=6)
    with torch.no_grad():
        plain = ref_model(**inputs).sample
        ref_calls = []
        with _hook(kind, ref_model.get_submodule(path), ref_calls):
            ref = ref_model(**inputs).sample
        assert not torch.equal(ref, plain)
        fp.patch(model)
        try:
            calls = []
            with _hook(kind, model.get_submodule(path), calls):  # on the very first call
                assert torch.equal(model(**inputs).sample, ref) and len(calls) == len(ref_calls)
            assert all(OPS[name].disabled is None for name in MODULE_OPS), {n: OPS[n].disabled for n in MODULE_OPS}
            assert torch.equal(model(**inputs).sample, plain)  # hook-free: every site fast, verified
            assert OPS["layernorm_scale_shift"].verified and OPS["qk_norm_rope"].verified
            calls = []
            with _hook(kind, model.get_submodule(path), calls):  # after the ops verified
                assert torch.equal(model(**inputs).sample, ref) and len(calls) == len(ref_calls)
        finally:
            fp.unpatch(model)
