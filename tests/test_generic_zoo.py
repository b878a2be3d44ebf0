"""The generic path on every class of the zoo (`diffusers_fastpath.testing.zoo`: the diffusers DiTs no family
adapter covers): patched == unpatched (``torch.equal``) with the fused paths' wiring run (kernels emulated on a CPU,
real on a GPU), verified on the first forward, every rewritten class counted, unpatch restoring every class."""

from __future__ import annotations

import inspect

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath._state import STATE_ATTR, sites_of
from diffusers_fastpath.testing import zoo

NAMES = sorted(zoo.ZOO)
# classes whose streams the kernels take in every block once made contiguous (`_chains._layout_free`): Wan's copies
CONTIGUOUS = ("wan-vace", "skyreels-v2", "chronoedit")


# the ops each of these classes' tiny config runs fused (emulated on a CPU) through the rewriter's forms for the 2026
# models (the gates computed as written, the modulate-rows form, the SwiGLU either way round, packed rows), at a
# width the wide RMSNorm kernels take (640), and diffusers' RMSNorm modules that run alone (`rmsnorm`)
FAST = {
    # its nn.RMSNorm + indexed-rows modulates; its QK norms + partial rotate-half rotary
    "minimax-h3": ("gated_residual", "rms_norm_modulate_rows", "silu_mul", "qk_norm_rotary_half"),
    "cosmos3": ("silu_mul", "rmsnorm"),  # its pre-norms and QK norms: diffusers' RMSNorm, alone
    "stable-audio-3": ("gated_residual", "silu_mul"),
    "qwen-image-21": ("gated_residual", "rmsnorm_rope_complex"),  # its QK norms + rotary in a helper: inlined
    # (annotated rotary; its weightless norm2, audio_norm2 and the a2v / v2a norms: `rmsnorm` with a unit weight)
    "ltx2": ("modulate_scale_shift", "rmsnorm_modulate", "gated_residual", "qk_norm_rows_rope", "rmsnorm"),
    "krea2": ("zero_centred_modulate", "gated_residual", "zero_centred_rmsnorm", "sigmoid_mul"),  # pre-norms with the modulate; the output gate
    "minimax-music3": ("silu_mul",),
    "stable-audio": ("silu_mul",),
    "nucleus-moe": ("gated_residual", "silu_mul"),
    "lumina-next": ("rmsnorm_scale", "rmsnorm_gated_residual"),
    # (ACE-Step's sandwich norms: not fast, its stream a transposed view that an RMSNorm reads as laid out, below)
    "bria-fibo2": ("rmsnorm_scale", "rmsnorm_gated_residual", "rmsnorm", "silu_mul"),  # silu_mul: its FeedForward helper
    "ideogram4": ("rmsnorm_scale", "rmsnorm_gated_residual", "rmsnorm", "attention_bool_mask"),  # its segment mask
    "sana-wm-refiner": ("rmsnorm_modulate", "modulate_scale_shift", "rotary_emb", "rmsnorm"),
    "sana": ("silu_mul",),  # GLUMBConv's x * silu(gate) on the channel halves of a feature map
    "kandinsky6": ("rotary_matrix",),  # its module's apply_rotary (by digest)
    "kandinsky6-sr": ("rotary_matrix",),
    "kandinsky5": ("rotary_matrix",),  # the function its processor defines (by digest)
}


def _sample(out):
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def _check(name, device):
    entry = zoo.ZOO[name]
    model = zoo.build(name, dtype=entry.cpu_dtype if device == "cpu" and entry.cpu_dtype else torch.bfloat16,
                      device=device)
    kwargs = zoo.inputs(name, model)
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    classes = [type(m) for m in model.modules()]
    fp.patch(model)
    try:
        sites = [s for m in model.modules() for _, s in sites_of(m)]
        with torch.no_grad():
            first = _sample(model(**kwargs)).clone()  # verified: run both ways
            second = _sample(model(**kwargs))  # trusted
        assert STATE_ATTR in model.__dict__, f"{name}: unpatched by its verification"
        assert torch.equal(first, ref) and torch.equal(second, ref)
        state = model.__dict__[STATE_ATTR]
        assert len(state.verifier.verified) == 1
        return sites
    finally:
        fp.unpatch(model)
        assert [type(m) for m in model.modules()] == classes


@pytest.mark.parametrize("name", NAMES)
def test_generic_patch_matches_unpatched(name, emulated_kernels):
    if zoo.ZOO[name].skip:
        pytest.skip(zoo.ZOO[name].skip)
    sites = _check(name, "cpu")
    if name in CONTIGUOUS:  # the stream, a transposed view at the first block, taken in memory order: no fallback,
        # every gated residual fast (the cross-attentions' rotary sites count nothing: they get no rotary table;
        # SkyReels-V2's per-token modulate rows take a branch with no pattern)
        assert sites and not any(s.fallback for s in sites), sites
        assert all(s.fast > 0 for s in sites if s.op.startswith("gated_residual")), sites
    for op in FAST.get(name, ()):
        assert sum(s.fast for s in sites if s.op == op) > 0, (op, sites)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_generic_patch_matches_unpatched_on_cuda(name):
    sites = _check(name, "cuda")
    fast = sum(s.fast for s in sites)
    reasons = sorted({r for s in sites for r in s.fallback})
    print(f"{name}: {len(sites)} sites, {fast} fast calls, fallbacks: {reasons}")


def test_ltx2_split_rotary_branch_runs_its_qk_norms_as_written(emulated_kernels):
    """LTX-2's processor fuses its QK norms into the interleaved rotary; its ``elif attn.rope_type == "split"`` branch
    (LTX-2.3's split rotary, no fused form) reads the pending norms, which run there as written (`materialize`):
    patched == unpatched with the split rotary, and the norms' sites count nothing fused there."""
    from diffusers_fastpath.testing.zoo._zoo import randomize_

    entry = zoo.ZOO["ltx2"]
    torch.manual_seed(0)
    model = randomize_(entry.cls(**{**entry.tiny_config, "rope_type": "split"}).to(torch.bfloat16), 0).eval()
    kwargs = zoo.inputs("ltx2", model)
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            got = _sample(model(**kwargs))
        assert torch.equal(got, ref)
        processors = {type(m.processor) for m in model.modules()
                      if hasattr(m, "processor") and getattr(m, "rope_type", None) == "split"}
        assert processors and all("apply_split_rotary_emb(_diffusers_fastpath_chains.materialize(query)"
                                  in inspect.getsource(p.__call__) for p in processors)  # the pending norm, run there
        sites = [s for m in model.modules() for _, s in sites_of(m)]
        assert not any(s.fast for s in sites if s.op in ("qk_norm_rows_rope", "rotary_emb")), sites
        assert any(s.fast for s in sites if s.op == "gated_residual")
    finally:
        fp.unpatch(model)


def test_the_stream_keeps_its_layout_where_an_rmsnorm_reads_it(emulated_kernels):
    """ACE-Step hands its blocks the stream as a transposed view and norms it with diffusers' RMSNorm, which reduces
    and multiplies x as laid out and keeps its layout: the stream is not made contiguous there (only a LayerNorm reads
    a contiguous copy whatever x's layout), so every Linear after it reads what it reads unpatched (a GEMM on another
    layout may round otherwise; a dropout draws its mask in memory order)."""
    entry = zoo.ZOO["ace-step"]
    model = zoo.build("ace-step", dtype=entry.cpu_dtype or torch.bfloat16, device="cpu")
    kwargs = zoo.inputs("ace-step", model)

    def strides():
        seen = []
        handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].stride()))
                   for m in model.modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            model(**kwargs)
        for h in handles:
            h.remove()
        return seen

    written = strides()
    fp.patch(model, verify=False)
    try:
        assert strides() == written
    finally:
        fp.unpatch(model)


def test_patching_twice_changes_nothing(emulated_kernels):
    """HiDream names its blocks in ``_no_split_modules`` only, which the patched blocks (this package's subclasses)
    no longer match: a second `patch` (or one with another quality) found "no repeated transformer blocks" and
    raised. It changes nothing now, as for every other model."""
    model = zoo.build("hidream", dtype=torch.bfloat16, device="cpu")
    kwargs = zoo.inputs("hidream", model)
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    fp.patch(model)
    try:
        classes = [type(m) for m in model.modules()]
        sites = [s for m in model.modules() for _, s in sites_of(m)]
        fp.patch(model)
        fp.patch(model, quality="high")
        assert [type(m) for m in model.modules()] == classes
        assert [s for m in model.modules() for _, s in sites_of(m)] == sites
        with torch.no_grad():
            assert torch.equal(_sample(model(**kwargs)), ref)
    finally:
        fp.unpatch(model)
