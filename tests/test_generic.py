"""The generic path (`diffusers_fastpath.models.generic`) and its model-level verification
(`diffusers_fastpath.verify`), on a transformer defined here (not a diffusers class): its chains are found from its
own code, it is verified on its first forward per input signature, and a planted mismatch is caught, named and
undone."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath import verify
from diffusers_fastpath._state import STATE_ATTR, sites_of
from diffusers_fastpath.testing._common import randomize_


class TinyBlock(nn.Module):
    """A DiT block written as diffusers writes them: adaLN modulate, gated residuals, a SwiGLU."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(dim, 6 * dim)
        self.attn = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.ada(temb).chunk(6, dim=1)
        norm_hidden_states = self.norm1(hidden_states) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        attn_output = self.attn(norm_hidden_states)
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        a, b = self.up(norm_hidden_states).chunk(2, dim=-1)
        ff_output = self.down(F.silu(a) * b)
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
        return hidden_states


class TinyTransformer(ModelMixin, ConfigMixin):
    """A transformer that is no diffusers class: the generic path takes it from its own ``_repeated_blocks``."""

    _repeated_blocks = ["TinyBlock"]

    @register_to_config
    def __init__(self, dim: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(16, dim)
        self.time = nn.Linear(1, dim)
        self.transformer_blocks = nn.ModuleList([TinyBlock(dim) for _ in range(layers)])
        self.proj_out = nn.Linear(dim, 16)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False):
        x = self.proj_in(hidden_states)
        temb = F.silu(self.time(timestep[:, None].to(x.dtype)))
        for block in self.transformer_blocks:
            x = block(x, temb)
        out = self.proj_out(x)
        return (out,) if not return_dict else {"sample": out}


def _tiny(dtype=torch.bfloat16, seed=0):
    return randomize_(TinyTransformer().to(dtype), seed).eval()


def _inputs(seed=1, batch=1, tokens=24, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, tokens, 16, generator=gen).to(dtype),
                timestep=torch.rand(batch, generator=gen) * 1000)


def _sites(model):
    return [site for m in model.modules() for _, site in sites_of(m)]


def test_own_transformer_is_patched_generically_and_verified(emulated_kernels, unpatch_after):
    model = _tiny()
    kwargs = _inputs()
    with torch.no_grad():
        ref = model(**kwargs)[0]
    unpatch_after(fp.patch(model))
    sites = _sites(model)
    ops = sorted(s.op for s in sites)
    assert ops.count("gated_residual") == 4 and ops.count("layernorm_scale_shift") == 4 and ops.count("silu_mul") == 2
    with torch.no_grad():
        out = model(**kwargs)[0]
        again = model(**_inputs(seed=2))[0]  # the same signature: trusted, no second verification
    assert torch.equal(out, ref)
    assert all(s.fast >= 1 and not s.fallback for s in sites), [repr(s) for s in sites]
    state = model.__dict__[STATE_ATTR]
    assert len(state.verifier.verified) == 1
    with torch.no_grad():
        model(**_inputs(batch=2))  # a new signature: verified too
    assert len(state.verifier.verified) == 2
    text = str(fp.report(model))
    assert "generic path" in text and "verified as diffusers wrote it: 2 input signature(s)" in text
    assert again.shape == out.shape


def _plant_one_element_off(monkeypatch) -> None:
    """The gated residual's (emulated) kernel, made to differ from eager in one element."""
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL

    right = GATED_RESIDUAL.kernel

    def one_element_off(residual, gate, update):
        out = right(residual, gate, update)
        out.view(-1)[7] = out.view(-1)[7] * 2 + 1
        return out

    monkeypatch.setattr(GATED_RESIDUAL, "kernel", one_element_off)


def test_planted_mismatch_is_caught_on_first_forward_and_unpatches(emulated_kernels, fastpath_log, monkeypatch):
    _plant_one_element_off(monkeypatch)
    model = _tiny()
    kwargs = _inputs()
    with torch.no_grad():
        ref = model(**kwargs)[0]
    classes = [type(m) for m in model.modules()]
    fp.patch(model)
    with torch.no_grad():
        out = model(**kwargs)[0]
    assert torch.equal(out, ref)  # the call that found the mismatch returns what diffusers computes
    assert STATE_ATTR not in model.__dict__ and [type(m) for m in model.modules()] == classes
    warnings = [r for r in fastpath_log.records if r.levelno == logging.WARNING and "generic path" in r.getMessage()]
    assert len(warnings) == 1
    assert "TinyTransformer.transformer_blocks.0 (" in warnings[0].getMessage()
    assert "failed verification" in str(fp.report(model))
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref)  # unpatched for good: the planted kernel no longer runs


def test_planted_mismatch_is_caught_through_hooks_added_after_patch(emulated_kernels, fastpath_log, monkeypatch):
    """A diffusers hook registered on the blocks after `patch` (group offloading, layerwise casting do so) keeps the
    block's patched forward bound: the reference run must still compute as diffusers wrote it (the rewritten forward
    calls its original on an object whose class is diffusers' again, `_chains._stale_check`), or it would compare
    the patched code with itself."""
    from diffusers.hooks import HookRegistry, ModelHook

    _plant_one_element_off(monkeypatch)
    model = _tiny()
    kwargs = _inputs()
    with torch.no_grad():
        ref = model(**kwargs)[0]
    fp.patch(model)
    for block in model.transformer_blocks:  # a pass-through hook: it binds the patched forward it wraps
        HookRegistry.check_if_exists_or_initialize(block).register_hook(ModelHook(), "pass_through")
    with torch.no_grad():
        out = model(**kwargs)[0]
    assert torch.equal(out, ref)
    assert STATE_ATTR not in model.__dict__  # caught: unpatched
    assert "failed verification" in str(fp.report(model))


def test_verification_can_be_skipped(emulated_kernels, unpatch_after, monkeypatch):
    model = _tiny()
    unpatch_after(fp.patch(model, verify=False))
    assert not model._forward_hooks and not model._forward_pre_hooks
    fp.unpatch(model)
    monkeypatch.setenv(verify.ENV_VERIFY, "0")
    fp.patch(model)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert "verification skipped" in str(fp.report(model))


def _foreign_forward(self, *args, **kwargs):  # a cache library's instance wrapper, as cache-dit installs one
    return type(self).forward(self, *args, **kwargs)


def test_stateful_wrapper_added_after_patch_unpatches_instead_of_a_second_forward(emulated_kernels, fastpath_log):
    model = _tiny()
    kwargs = _inputs()
    with torch.no_grad():
        ref = model(**kwargs)[0]
    fp.patch(model)
    calls = []

    def wrapper(*args, **kw):
        calls.append(1)
        return _foreign_forward(model, *args, **kw)

    wrapper.__globals__  # noqa: B018 - defined in this test module: not a package this one trusts
    model.forward = wrapper
    with torch.no_grad():
        out = model(**kwargs)[0]
    assert torch.equal(out, ref) and len(calls) == 1  # one forward through the wrapper, as diffusers alone
    assert STATE_ATTR not in model.__dict__
    assert any("cannot be verified" in r.getMessage() for r in fastpath_log.records)


def _double_input(module, args, kwargs):
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 2}


def _scale_output(module, args, kwargs, output):
    return (output[0] * 3,)


def _warned(log):  # this package's warnings (not diffusers' own, e.g. its note on `.to(dtype)`)
    return [r.getMessage() for r in log.records if r.levelno == logging.WARNING and "diffusers_fastpath" in r.getMessage()]


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
@torch.no_grad()
def test_a_hook_on_the_model_that_changes_its_input_or_output(when, emulated_kernels, fastpath_log, unpatch_after):
    """A user's forward pre-hook (rescaling the input) and forward hook (scaling the output) on the model itself:
    the check, which copies the arguments before the model's later pre-hooks change them and compares an output that
    its earlier forward hooks changed, would have taken the patched result for wrong, returned its reference (the
    forward without the hooks' changes) and unpatched the model. While such hooks are on, a new signature runs as
    diffusers wrote it, once; once they are gone, its next call is checked."""
    model = _tiny()
    kwargs = _inputs()
    handles = [model.register_forward_pre_hook(_double_input, with_kwargs=True),
               model.register_forward_hook(_scale_output, with_kwargs=True)]
    ref = model(**kwargs)[0]
    for h in handles:
        h.remove()
    plain = model(**kwargs)[0]
    if when == "before_patch":
        handles = [model.register_forward_pre_hook(_double_input, with_kwargs=True),
                   model.register_forward_hook(_scale_output, with_kwargs=True)]
    unpatch_after(fp.patch(model))
    if when == "after_patch":
        handles = [model.register_forward_pre_hook(_double_input, with_kwargs=True),
                   model.register_forward_hook(_scale_output, with_kwargs=True)]
    assert torch.equal(model(**kwargs)[0], ref)
    assert not _warned(fastpath_log) and STATE_ATTR in model.__dict__
    assert "has forward hooks" in str(fp.report(model)) and not model.__dict__[STATE_ATTR].verifier.verified
    for h in handles:
        h.remove()
    assert torch.equal(model(**kwargs)[0], plain)
    assert len(model.__dict__[STATE_ATTR].verifier.verified) == 1 and not _warned(fastpath_log)


@torch.no_grad()
def test_a_global_forward_hook_that_changes_the_output(emulated_kernels, fastpath_log, unpatch_after):
    """Global module hooks run before the model's own forward hooks: the check would read a changed output."""
    from torch.nn.modules.module import register_module_forward_hook

    model = _tiny()
    kwargs = _inputs()
    handle = register_module_forward_hook(lambda m, a, out: (out[0] * 3,) if m is model else None)
    try:
        ref = model(**kwargs)[0]
        unpatch_after(fp.patch(model))
        out = model(**kwargs)[0]
    finally:
        handle.remove()
    assert torch.equal(out, ref) and not _warned(fastpath_log) and STATE_ATTR in model.__dict__


class _StepScale:
    """A block hook that depends on how many steps ran (schedule-driven research code): state a second forward
    would advance."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, args, output):
        self.calls += 1
        return output * (1 + 0.25 * self.calls)


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
@torch.no_grad()
def test_a_stateful_hook_on_a_block_runs_once_per_call(when, emulated_kernels, fastpath_log):
    ref_model, model = _tiny(), _tiny()
    ref_model.transformer_blocks[0].register_forward_hook(_StepScale())
    steps = [_inputs(seed=s) for s in (1, 2, 3)]
    ref = [ref_model(**k)[0] for k in steps]
    hook = _StepScale()
    if when == "before_patch":
        model.transformer_blocks[0].register_forward_hook(hook)
    fp.patch(model)
    if when == "after_patch":
        model.transformer_blocks[0].register_forward_hook(hook)
    got = [model(**k)[0] for k in steps]
    assert STATE_ATTR in model.__dict__ and not _warned(fastpath_log)
    fp.unpatch(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and hook.calls == 3


def test_verification_restores_rng_and_checks_it(emulated_kernels, unpatch_after):
    model = _tiny()
    kwargs = _inputs()
    torch.manual_seed(0)
    with torch.no_grad():
        model(**kwargs)
    after_unpatched = torch.random.get_rng_state()
    unpatch_after(fp.patch(model))
    torch.manual_seed(0)
    with torch.no_grad():
        model(**kwargs)
    assert torch.equal(torch.random.get_rng_state(), after_unpatched)


def test_deepcopy_of_a_generic_model_verifies_on_its_own(emulated_kernels, unpatch_after):
    model = _tiny()
    unpatch_after(fp.patch(model))
    with torch.no_grad():
        model(**_inputs())
    twin = copy.deepcopy(model)
    unpatch_after(twin)
    assert twin.__dict__[STATE_ATTR].verifier is not model.__dict__[STATE_ATTR].verifier
    with torch.no_grad():
        assert torch.equal(twin(**_inputs())[0], model(**_inputs())[0])


def test_unet_is_refused_with_the_reason():
    from diffusers import UNet2DModel

    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(32, 32), layers_per_block=1,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                       norm_num_groups=8)
    with pytest.raises(TypeError, match="UNet"):
        fp.patch(unet)


def test_a_generic_model_pickles_and_loads_patched_in_a_fresh_process(emulated_kernels, tmp_path):
    import subprocess
    import sys

    from diffusers_fastpath.testing import zoo

    model = zoo.build("wan-vace")
    kwargs = zoo.inputs("wan-vace", model)
    with torch.no_grad():
        ref = model(**kwargs)[0]
    fp.patch(model)
    path = tmp_path / "model.pt"
    torch.save({"model": model, "kwargs": kwargs, "ref": ref}, path)
    fp.unpatch(model)
    script = f"""
import torch, diffusers_fastpath as fp
from diffusers_fastpath._state import STATE_ATTR
blob = torch.load({str(path)!r}, weights_only=False)
model = blob["model"]
assert STATE_ATTR in model.__dict__
names = {{type(m).__qualname__ for m in model.modules()}}
assert any(n.startswith("FastpathGeneric_") for n in names), names
with torch.no_grad():
    out = model(**blob["kwargs"])[0]
assert torch.equal(out, blob["ref"])
fp.unpatch(model)
assert not any(type(m).__module__.startswith("diffusers_fastpath") for m in model.modules())
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_coverage_says_how_each_class_is_taken_and_the_docs_table_is_its_output():
    from pathlib import Path

    from diffusers_fastpath.models import generic

    rows = fp.coverage()
    how = {name: kind for name, kind, _ in rows}
    assert set(fp.supported_classes()) == {n for n, k in how.items() if k == "family"}
    assert how["WanVACETransformer3DModel"] == how["Flux3Transformer2DModel"] == "generic"
    table = (Path(__file__).parents[1] / "docs" / "coverage.md").read_text()
    assert generic.coverage_markdown() in table, "docs/coverage.md is stale: regenerate it (python -m diffusers_fastpath.models.generic)"
    # the README's model table: its generic row counts the classes coverage() takes generically
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    generic_count = sum(kind == "generic" for kind in how.values())
    assert f"every other diffusers transformer ({generic_count} classes:" in readme, "README's model table: generic count"


def test_a_known_rotary_is_known_with_annotations_too():
    """LTX-2's ``apply_interleaved_rotary_emb`` is LTX-Video's ``apply_rotary_emb`` with annotated parameters: the
    generic path knows it as the rows form (its processors' rotary fused); a change of its code is not known."""
    import ast as ast_

    from diffusers.models.transformers import transformer_ltx, transformer_ltx2

    from diffusers_fastpath._source import definition
    from diffusers_fastpath.models import generic

    known = generic.known_rotaries()
    assert known.get(generic._form_digest(transformer_ltx2.apply_interleaved_rotary_emb)) == "rows"
    assert generic._form_digest(transformer_ltx2.apply_interleaved_rotary_emb) == generic._form_digest(
        transformer_ltx.apply_rotary_emb)
    changed = definition(transformer_ltx2.apply_interleaved_rotary_emb)
    changed.body[-1] = ast_.parse("return out * 1").body[0]
    assert generic._form_digest(changed) not in known
    hints = generic.processor_hints(transformer_ltx2.LTX2AudioVideoAttnProcessor.__call__)
    assert hints == {"rows_rotary": "apply_interleaved_rotary_emb"}


class _GradModeLinear(nn.Linear):
    def forward(self, x):
        out = super().forward(x)
        return out * 2 if torch.is_grad_enabled() else out


def test_a_mismatch_under_autograd_returns_diffusers_result_with_its_graph(emulated_kernels, fastpath_log):
    """A call whose verification fails under autograd returns what diffusers computes there, with its graph on the
    caller's own tensors (the reference run has none: it runs without autograd, on copies), so that ``backward``
    gives diffusers' gradients. The mismatch here: a layer whose result depends on the grad mode (torch's own backward
    hooks can change a layout so), which the reference run, without autograd, does not see."""
    import copy

    model = _tiny()
    model.proj_in.__class__ = _GradModeLinear
    twin = copy.deepcopy(model)
    kwargs = _inputs()
    fp.patch(model)
    results = []
    for m in (twin, model):
        x = kwargs["hidden_states"].clone().requires_grad_()
        out = m(**{**kwargs, "hidden_states": x})[0]
        out.float().square().mean().backward()
        results.append((out.detach(), x.grad))
    (ref, ref_grad), (out, grad) = results
    assert STATE_ATTR not in model.__dict__ and "failed verification" in str(fp.report(model))
    assert torch.equal(out, ref) and grad is not None and torch.equal(grad, ref_grad)


def test_helper_methods_are_the_forwards_self_calls_of_functions_in_order():
    """Where a class's ``forward`` matches no pattern, the generic path tries the methods it calls (Bria FIBO 2's
    ``FeedForward._forward_silu_gating``); submodules called as ``self.w1(x)`` are not methods, and names repeat once."""
    from diffusers.models.transformers.transformer_bria_fibo2 import FeedForward

    from diffusers_fastpath.models.generic import helper_methods

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def _gate(self, x):
            return torch.nn.functional.silu(x) * x

        def _scale(self, x):
            return 2 * x

        def forward(self, x):
            return self._scale(self._gate(self.proj(x))) + self._gate(x)

    assert helper_methods(FeedForward) == ["_forward_silu_gating"]
    assert helper_methods(Block) == ["_scale", "_gate"]
    assert helper_methods(torch.nn.Linear) == []
