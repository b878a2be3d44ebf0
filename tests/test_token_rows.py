"""Bria FIBO 2's and Z-Image's ``select_per_token`` rows read through an index (`ops/selected_rows.TokenRows`): the
rows object (its index, computed by the model's own function), the rewriter's pass (`_chain_token_rows`), the two
fused RMSNorm ops that read the rows (`rmsnorm_scale_rows`, `rmsnorm_gated_residual_rows`: guards, fallbacks), the
tiny ``bria-fibo2`` model patched == unpatched (batch 1 and 2, with and without context latents: the refiner's
per-token and global branches) with the rows fast, never written out, and their index made once per forward
(emulated kernels); a block with hooks, masks of every kind, Z-Image's block; on the GPU both raw kernels and both
ops at Bria FIBO 2's full-size shapes with poisoned outputs, and an out-of-range index trapping."""

from __future__ import annotations

import ast
import copy
import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers import transformer_bria_fibo2, transformer_z_image

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models import _chain_token_rows
from diffusers_fastpath.models._chain_proofs import Proofs
from diffusers_fastpath.models._chain_token_rows import known_select, lazy_token_rows, token_rows
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.selected_rows import TokenRows, token_index
from diffusers_fastpath.testing import zoo

rms = importlib.import_module("diffusers_fastpath.ops.rmsnorm_scale_shift")  # (ops binds the name to the function)
select = transformer_bria_fibo2.select_per_token
DTYPES = [torch.bfloat16, torch.float16]


def _sample(out):
    while isinstance(out, (list, tuple)):
        out = out[0]
    return out


def make_rows(batch, seq, dim, dtype, device, seed, layout="gist first"):
    """Bria FIBO 2's operands: noisy and clean ``[B, D]`` rows (a scale's ``1.0 + m`` and a gate's ``tanh``), and its
    long ``[B, S]`` noise mask: the image tokens 1, the gist (first, or last where a batch pads it) 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mod = torch.randn(2, batch, 2 * dim, generator=gen, device=device).to(dtype)
    (scale_noisy, gate_noisy), (scale_clean, gate_clean) = (m.chunk(2, dim=1) for m in mod)
    mask = torch.zeros(batch, seq, dtype=torch.long, device=device)
    gist = seq // 9
    if layout == "gist first":
        mask[:, gist:] = 1
    elif layout == "gist last":
        mask[:, : seq - gist] = 1
    elif layout == "all noisy":
        mask[:] = 1
    elif layout == "all clean":
        pass
    else:  # any values: only those equal to 1 are noisy
        mask = torch.randint(-1, 3, (batch, seq), generator=gen, device=device)
    return (1.0 + scale_noisy, 1.0 + scale_clean), (gate_noisy.tanh(), gate_clean.tanh()), mask


def make_norm(dim, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = RMSNorm(dim, eps=1e-5).to(device)
    norm.weight.data = (torch.rand(dim, generator=gen, device=device) + 0.5).to(dtype)
    return norm


@pytest.fixture
def checked():
    assert known_select(select) and known_select(transformer_z_image.select_per_token)


# --- the rows object -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["gist first", "gist last", "all noisy", "all clean", "any values"])
def test_index_is_the_row_the_where_picks(layout, checked):
    (noisy, clean), _, mask = make_rows(2, 18, 8, torch.bfloat16, "cpu", 0, layout)
    index = token_index(select, mask, 18)
    assert index.dtype is torch.int32 and index.shape == (2, 18) and index.is_contiguous()
    expected = torch.where(mask == 1, torch.arange(2)[:, None], 2 + torch.arange(2)[:, None])
    assert torch.equal(index.long(), expected)
    rows = token_rows(select, noisy, clean, mask, 18)
    assert type(rows) is TokenRows and torch.equal(rows.table(), torch.cat([noisy, clean]))
    assert torch.equal(rows.table()[rows.index().long()], select(noisy, clean, mask, 18))
    assert torch.equal(rows.materialize(), select(noisy, clean, mask, 18))


def test_rows_are_what_the_where_read_at_its_call(checked):
    """The table and the mask are copies made at the call: a later write into the operands changes nothing."""
    (noisy, clean), _, mask = make_rows(1, 18, 8, torch.bfloat16, "cpu", 1)
    expected = select(noisy, clean, mask, 18)
    rows = token_rows(select, noisy, clean, mask, 18)
    noisy.add_(1), clean.mul_(3), mask.fill_(1)
    assert torch.equal(rows.materialize(), expected)
    assert torch.equal(rows.table()[rows.index().long()], expected)


@pytest.mark.parametrize("case", ["float32", "mask shape", "seq_len", "grad", "unchecked function", "two dtypes",
                                  "compiling"])
def test_other_operands_are_the_call_as_written(case, checked, monkeypatch):
    (noisy, clean), _, mask = make_rows(1, 18, 8, torch.bfloat16, "cpu", 2)
    fn, seq = select, 18
    if case == "float32":
        noisy, clean = noisy.float(), clean.float()
    elif case == "mask shape":
        mask = mask[:, None]
    elif case == "seq_len":
        seq = 1  # (the where broadcasts rows expanded to 1 token over the mask's 18; not the form)
    elif case == "grad":
        noisy.requires_grad_(True)
    elif case == "unchecked function":
        fn = lambda a, b, m, n: select(a, b, m, n)  # noqa: E731
    elif case == "two dtypes":
        clean = clean.half()
    elif case == "compiling":  # (the graph computes the where: the fused calls get a tensor)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = token_rows(fn, noisy, clean, mask, seq)
    assert isinstance(out, torch.Tensor) and torch.equal(out, select(noisy, clean, mask, seq))


def test_reason_admits_the_wheres_shape_only(checked):
    (noisy, clean), _, mask = make_rows(2, 18, 8, torch.bfloat16, "cpu", 3)
    rows = token_rows(select, noisy, clean, mask, 18)
    assert rows.reason(torch.randn(2, 18, 8).bfloat16()) is None
    assert rows.reason(torch.randn(1, 18, 8).bfloat16()) == "rows shape"
    assert rows.reason(torch.randn(2, 18, 16).bfloat16()) == "rows shape"
    assert rows.reason(torch.randn(2, 18, 8)) == "mixed dtypes"


# --- the rewriter's pass -------------------------------------------------------------------------------------------

_GLOBALS = {"select_per_token": select, "other": lambda a, b, m, n: a}


def _pass(src):
    func = ast.parse(textwrap.dedent(src)).body[0]
    proofs = Proofs(func, {"self"})
    body = copy.deepcopy(func.body)
    proofs.tag(body)
    count = lazy_token_rows(body, "ns", proofs, _GLOBALS)
    return count, ast.unparse(ast.Module(body=body, type_ignores=[]))


_TAKEN = """
    def forward(self, x, a, b, c, d, m, n, s):
        if m is not None:
            scale = select_per_token(a, b, m, n)
            gate = select_per_token(c, d, m, n)
        else:
            scale, gate = a.chunk(2, dim=2)
            scale = 1.0 + scale
        y = self.attn(ns.rms_scale(self.norm1, x, scale, s))
        x = ns.rms_gated_residual(self.norm2, x, gate, y, s)
        return x
"""


def test_pass_takes_the_selects_only_a_fused_norm_reads():
    count, out = _pass(_TAKEN)
    assert count == 2
    assert "scale = ns.token_rows(select_per_token, a, b, m, n)" in out
    assert "gate = ns.token_rows(select_per_token, c, d, m, n)" in out
    assert "scale = 1.0 + scale" in out  # the other branch's reads are the other branch's values


@pytest.mark.parametrize("case", {
    "read again": ("x = ns.rms_gated_residual(self.norm2, x, gate, y, s)",
                   "x = ns.rms_gated_residual(self.norm2, x, gate, y, s) + gate"),
    "read by another op": ("x = ns.rms_gated_residual(self.norm2, x, gate, y, s)", "x = x + gate * self.norm2(y)"),
    "read after": ("return x", "return x, gate"),
    "two readers": ("return x", "return ns.rms_gated_residual(self.norm2, x, gate, y, s)"),
    "another function": ("gate = select_per_token(c, d, m, n)", "gate = other(c, d, m, n)"),
    "keyword": ("gate = select_per_token(c, d, m, n)", "gate = select_per_token(c, d, m, seq_len=n)"),
    "not a name": ("gate = select_per_token(c, d, m, n)", "gate = select_per_token(c, d.tanh(), m, n)"),
    "a compound statement reads it": ("x = ns.rms_gated_residual(self.norm2, x, gate, y, s)",
                                      "if ns.rms_gated_residual(self.norm2, x, gate, y, s) is not None:\n"
                                      "            x = y"),
}.items(), ids=lambda c: c[0])
def test_pass_keeps_every_other_form(case):
    _, (old, new) = case
    count, out = _pass(_TAKEN.replace(old, new))
    assert count == 1 and "scale = ns.token_rows(select_per_token, a, b, m, n)" in out  # the scale's still taken
    assert "ns.token_rows(select_per_token, c" not in out and "ns.token_rows(other" not in out


def test_pass_keeps_a_function_the_forward_binds():
    count, out = _pass(_TAKEN.replace("if m is not None:", "select_per_token = other\n        if m is not None:"))
    assert count == 0 and "token_rows" not in out


# --- the ops: guards and fallbacks (kernels emulated) ----------------------------------------------------------------


def _operands(batch=2, seq=18, dim=640, dtype=torch.bfloat16, seed=4, layout="gist first"):
    (scale_noisy, scale_clean), (gate_noisy, gate_clean), mask = make_rows(batch, seq, dim, dtype, "cpu", seed, layout)
    gen = torch.Generator().manual_seed(seed + 1)
    x, residual = (torch.randn(2, batch, seq, dim, generator=gen) * 3).to(dtype).unbind(0)
    return (make_norm(dim, dtype, "cpu", seed), x, residual, (scale_noisy, scale_clean, mask, seq),
            (gate_noisy, gate_clean, mask, seq))


def test_ops_read_the_rows_through_the_index(emulated_kernels, checked):
    norm, x, residual, scale_args, gate_args = _operands()
    scale, gate = token_rows(select, *scale_args), token_rows(select, *gate_args)
    site, gated_site = Site("rmsnorm_scale"), Site("rmsnorm_gated_residual")
    with torch.no_grad():
        assert torch.equal(rms.rmsnorm_scale_rows(norm, x, scale, site), norm(x) * select(*scale_args))
        got = rms.rmsnorm_gated_residual_rows(norm, residual, gate, x, gated_site)
        assert torch.equal(got, residual + select(*gate_args) * norm(x))
    assert (site.fast, gated_site.fast) == (1, 1) and not site.fallback and not gated_site.fallback


@pytest.mark.parametrize("case", ["float32 x", "x transposed", "hooked norm", "other batch", "odd width"])
def test_fallbacks_are_the_models_expression(case, emulated_kernels, checked):
    norm, x, residual, scale_args, gate_args = _operands(dim=384 if case == "odd width" else 640)
    scale, gate = token_rows(select, *scale_args), token_rows(select, *gate_args)
    calls = []
    if case == "float32 x":
        x, residual = x.float(), residual.float()
    elif case == "x transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "hooked norm":
        norm.register_forward_hook(lambda *args: calls.append(1))
    elif case == "other batch":
        x, residual = x[:1], residual[:1]
    site, gated_site = Site("rmsnorm_scale"), Site("rmsnorm_gated_residual")
    with torch.no_grad():
        expected = norm(x) * select(*scale_args), residual + select(*gate_args) * norm(x)
        got = rms.rmsnorm_scale_rows(norm, x, scale, site), rms.rmsnorm_gated_residual_rows(norm, residual, gate, x,
                                                                                              gated_site)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert site.fast == gated_site.fast == 0 and sum(site.fallback.values()) == sum(gated_site.fallback.values()) == 1
    if case == "hooked norm":
        assert len(calls) == 4  # the eager expression called the norm (and its hook) as the model does
        assert list(site.fallback) == ["RMSNorm has hooks"]


def test_tensor_operands_are_the_plain_ops(emulated_kernels):
    norm, x, residual, _, _ = _operands()
    scale = torch.randn(2, 1, 640).bfloat16()
    site = Site("rmsnorm_scale")
    with torch.no_grad():
        assert torch.equal(rms.rmsnorm_scale_rows(norm, x, scale, site), norm(x) * scale) and site.fast == 1
        assert torch.equal(rms.rmsnorm_gated_residual_rows(norm, residual, scale, x, site), residual + scale * norm(x))


# --- the model ------------------------------------------------------------------------------------------------------


def _counted(monkeypatch, *ops):
    calls = {op.name: 0 for op in ops}
    for op in ops:
        def kernel(*args, _op=op, _kernel=op.kernel):
            calls[_op.name] += 1
            return _kernel(*args)
        monkeypatch.setattr(op, "kernel", kernel)
    return calls


def _norm_sites(*blocks):
    """The blocks' RMSNorm + scale and RMSNorm + gated residual sites (on their norms)."""
    return [s for b in (b for group in blocks for b in group) for m in b.modules() for _, s in sites_of(m)
            if s.op in ("rmsnorm_scale", "rmsnorm_gated_residual")]


def _fibo2_inputs(model, batch, context):
    kwargs = zoo.inputs("bria-fibo2", model, batch=batch)
    if context:  # an image to edit: the refiner's noise mask marks the image's tokens noisy, the context's clean
        gen = torch.Generator().manual_seed(5)
        latents = kwargs["hidden_states"]
        kwargs["context_latents"] = [torch.randn(latents.shape[0], latents.shape[1], 6, 8, generator=gen).to(
            latents.dtype)]
    return kwargs


@pytest.mark.parametrize("context", [False, True], ids=["global refiner", "context latents"])
@pytest.mark.parametrize("batch", [1, 2])
def test_zoo_bria_fibo2_patched_equal_unpatched_rows_never_written(batch, context, emulated_kernels, monkeypatch):
    model = zoo.build("bria-fibo2", dtype=torch.bfloat16)
    kwargs = _fibo2_inputs(model, batch, context)
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    classes = [type(m) for m in model.modules()]
    calls = _counted(monkeypatch, rms.RMSNORM_SCALE, rms.RMSNORM_SCALE_ROWS, rms.RMSNORM_GATED_RESIDUAL,
                     rms.RMSNORM_GATED_RESIDUAL_ROWS)
    indexes = []
    monkeypatch.setattr(_chain_token_rows, "token_index", lambda *a: indexes.append(1) or token_index(*a))
    fp.patch(model)
    try:
        for _ in range(2):  # verified, then trusted
            for name in calls:
                calls[name] = 0
            indexes.clear()
            with torch.no_grad():
                assert torch.equal(_sample(model(**kwargs)), ref)
        main, refiner = len(model.layers), len(model.noise_refiner)
        per_token = main + (refiner if context else 0)  # the blocks given a noise mask
        assert calls["rmsnorm_scale_rows"] == calls["rmsnorm_gated_residual_rows"] == 2 * per_token
        assert calls["rmsnorm_scale"] == calls["rmsnorm_gated_residual"] == 2 * (main + refiner - per_token)
        assert len(indexes) == (2 if context else 1)  # one index a mask and forward, shared by its blocks
        sites = _norm_sites(model.layers, model.noise_refiner)
        assert len(sites) == 4 * (main + refiner) and all(s.fast == 2 and not s.fallback for s in sites), sites
    finally:
        fp.unpatch(model)
    assert [type(m) for m in model.modules()] == classes


def test_zoo_bria_fibo2_with_a_hooked_norm_is_exact(emulated_kernels):
    """A hook on a block's norm: its calls refuse (the eager expression runs the hook), the others stay fast; the
    index is then made in each block (no forward is sealed where a module has hooks)."""
    model = zoo.build("bria-fibo2", dtype=torch.bfloat16)
    kwargs = _fibo2_inputs(model, 2, True)
    seen = []
    model.layers[1].ffn_norm2.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    fp.patch(model, verify=False)  # (the model-level check would run the model as written: its second run would
    # run the hook again)
    try:
        for _ in range(2):
            seen.clear()
            with torch.no_grad():
                assert torch.equal(_sample(model(**kwargs)), ref)
        assert len(seen) == 1  # the eager expression ran the norm, and its hook
        site = next(s for _, s in sites_of(model.layers[1].ffn_norm2) if s.op == "rmsnorm_gated_residual")
        assert site.fast == 0 and list(site.fallback) == ["FastpathRMSNorm has hooks"], site  # (its class, swapped)
        others = _norm_sites(model.layers[:1], model.noise_refiner)
        assert len(others) == 8 and all(s.fast == 2 for s in others)
    finally:
        fp.unpatch(model)


@pytest.mark.parametrize("layout", ["all noisy", "all clean", "any values", "gist last"])
def test_block_called_directly_with_any_mask_is_exact(layout, emulated_kernels):
    """A main block called outside the model's forward (nothing sealed: its own index), with masks of every kind."""
    model = zoo.build("bria-fibo2", dtype=torch.bfloat16)
    block = model.layers[0]
    dim, seq = 640, 20
    (noisy, clean), _, mask = make_rows(2, seq, 256, torch.bfloat16, "cpu", 6, layout)  # [B, 256]: the adaLN input
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, seq, dim, generator=gen).bfloat16()
    freqs = torch.polar(torch.ones(1, seq, 64), torch.rand(1, seq, 64, generator=gen))
    args = (x, None, freqs)
    kwargs = dict(noise_mask=mask, adaln_noisy=noisy, adaln_clean=clean,
                  encoder_hidden_states=None, encoder_attention_mask=None)
    with torch.no_grad():
        ref = block(*args, **kwargs)
    fp.patch(model)
    try:
        with torch.no_grad():
            assert torch.equal(model.layers[0](*args, **kwargs), ref)
        sites = _norm_sites(model.layers[:1])
        assert len(sites) == 4 and all(s.fast == 1 and not s.fallback for s in sites), sites
    finally:
        fp.unpatch(model)


def test_zimage_blocks_take_the_same_form(emulated_kernels, monkeypatch):
    """Z-Image's block (its omni mode's noisy / clean modulation) is recognised by the same digest: patched ==
    unpatched, its rows read through the index."""
    from diffusers_fastpath.testing.families import build_zimage_transformer

    model = build_zimage_transformer()
    block = model.layers[0]
    dim, seq = block.dim, 24
    mask = make_rows(2, seq, 8, torch.bfloat16, "cpu", 8)[2]
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, seq, dim, generator=gen).bfloat16()
    freqs = torch.polar(torch.ones(2, seq, block.head_dim // 2), torch.rand(2, seq, block.head_dim // 2, generator=gen))
    adaln = torch.randn(2, block.adaLN_modulation[0].in_features, generator=gen).bfloat16()
    args = (x, None, freqs, None, mask, adaln, adaln.flip(0))
    with torch.no_grad():
        ref = block(*args)
    calls = _counted(monkeypatch, rms.RMSNORM_SCALE_ROWS, rms.RMSNORM_GATED_RESIDUAL_ROWS)
    fp.patch(model)
    try:
        with torch.no_grad():
            assert torch.equal(model.layers[0](*args), ref)
        assert calls == {"rmsnorm_scale_rows": 2, "rmsnorm_gated_residual_rows": 2}
    finally:
        fp.unpatch(model)


# --- the GPU -------------------------------------------------------------------------------------------------------

FULL = (4096 + 512, 3584)  # Bria FIBO 2 at 1024x1024: 4096 image tokens and 512 gist tokens, 3584 wide


def poison_allocator(nbytes: int) -> None:
    """Leave NaNs in the caching allocator's free blocks, where the op's next output is likely to be allocated."""
    torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device="cuda")
    torch.cuda.synchronize()


def _gpu_operands(batch, dtype, seed, layout):
    seq, dim = FULL
    (scale_noisy, scale_clean), (gate_noisy, gate_clean), mask = make_rows(batch, seq, dim, dtype, "cuda", seed, layout)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    x, residual = (torch.randn(2, batch, seq, dim, generator=gen, device="cuda") * 3).to(dtype).unbind(0)
    return (make_norm(dim, dtype, "cuda", seed), x, residual, (scale_noisy, scale_clean, mask, seq),
            (gate_noisy, gate_clean, mask, seq))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["gist first", "gist last", "any values"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_raw_kernels_match_eager_bitwise_on_the_gpu(dtype, batch, layout, checked):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    norm, x, residual, scale_args, gate_args = _gpu_operands(batch, dtype, 10 + batch, layout)
    scale, gate = token_rows(select, *scale_args), token_rows(select, *gate_args)
    with torch.no_grad():
        expected = norm(x) * select(*scale_args), residual + select(*gate_args) * norm(x)
    poison_allocator(x.numel() * x.element_size())
    out = ops._rmsnorm_scale_rows_cuda(x, norm.weight, scale.table(), scale.index(), norm.eps)
    assert torch.equal(out, expected[0])
    poison_allocator(x.numel() * x.element_size())
    out = ops._rmsnorm_gated_residual_rows_cuda(residual, gate.table(), gate.index(), x, norm.weight, norm.eps)
    assert torch.equal(out, expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_through_nvrtc_equal_the_extension_on_the_gpu(dtype, checked):
    from diffusers_fastpath.ops import _build, _nvrtc

    nvcc = _build.load_extension() == "nvcc"
    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    norm, x, residual, scale_args, gate_args = _gpu_operands(2, dtype, 20, "gist last")
    scale, gate = token_rows(select, *scale_args), token_rows(select, *gate_args)
    with torch.no_grad():
        expected = norm(x) * select(*scale_args), residual + select(*gate_args) * norm(x)
    got = rms._nvrtc_scale_rows_kernel(x, norm.weight, scale.table(), scale.index(), norm.eps)
    got_residual = rms._nvrtc_gated_residual_rows_kernel(residual, gate.table(), gate.index(), x, norm.weight, norm.eps)
    assert torch.equal(got, expected[0]) and torch.equal(got_residual, expected[1])
    if nvcc:
        ops = torch.ops.diffusers_fastpath
        assert torch.equal(got, ops._rmsnorm_scale_rows_cuda(x, norm.weight, scale.table(), scale.index(), norm.eps))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_are_fast_and_verified_on_the_gpu(dtype, checked):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    norm, x, residual, scale_args, gate_args = _gpu_operands(2, dtype, 30, "gist first")
    scale, gate = token_rows(select, *scale_args), token_rows(select, *gate_args)
    site, gated_site = Site("rmsnorm_scale"), Site("rmsnorm_gated_residual")
    with torch.no_grad():
        expected = norm(x) * select(*scale_args), residual + select(*gate_args) * norm(x)
        got = rms.rmsnorm_scale_rows(norm, x, scale, site), rms.rmsnorm_gated_residual_rows(norm, residual, gate, x,
                                                                                              gated_site)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert site.fast == gated_site.fast == 1 and not site.fallback and not gated_site.fallback
    key = (str(dtype).removeprefix("torch."), FULL[1])
    for op in (rms.RMSNORM_SCALE_ROWS, rms.RMSNORM_GATED_RESIDUAL_ROWS):
        assert op.disabled is None and key in op.verified


@pytest.mark.gpu
@pytest.mark.parametrize("context", [False, True], ids=["global refiner", "context latents"])
def test_zoo_bria_fibo2_takes_the_rows_on_the_gpu(context):
    model = zoo.build("bria-fibo2", dtype=torch.bfloat16, device="cuda")
    kwargs = _fibo2_inputs(model, 2, context)
    kwargs = {k: [t.cuda() for t in v] if isinstance(v, list) else v for k, v in kwargs.items()}
    with torch.no_grad():
        ref = _sample(model(**kwargs)).clone()
    fp.patch(model)
    try:
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(_sample(model(**kwargs)), ref)
        sites = _norm_sites(model.layers, model.noise_refiner)
        assert len(sites) == 4 * 3 and all(s.fast == 2 and not s.fallback for s in sites), sites
        assert rms.RMSNORM_SCALE_ROWS.verified and rms.RMSNORM_GATED_RESIDUAL_ROWS.verified
    finally:
        fp.unpatch(model)


_TRAP = """
import sys, torch
from diffusers.models.normalization import RMSNorm
from diffusers_fastpath.ops._build import load_extension
load_extension()
ops = torch.ops.diffusers_fastpath
which, bad = sys.argv[1], int(sys.argv[2])
seq, dim = 4608, 3584
norm = RMSNorm(dim, eps=1e-5).cuda().bfloat16()
table = torch.randn(4, dim, device="cuda").bfloat16()
x = torch.randn(2, seq, dim, device="cuda").bfloat16()
index = torch.zeros(2, seq, dtype=torch.int32, device="cuda")
index[1, seq - 7] = bad
try:
    if which == "scale":
        out = ops._rmsnorm_scale_rows_cuda(x, norm.weight, table, index, 1e-5)
    else:
        out = ops._rmsnorm_gated_residual_rows_cuda(x, table, index, x, norm.weight, 1e-5)
    torch.cuda.synchronize()
except RuntimeError as exc:
    print("FAILED:", exc)
    sys.exit(3)
print("NO FAILURE")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["scale", "gated"])
@pytest.mark.parametrize("bad", [4, -1])
def test_out_of_range_index_traps_on_the_gpu(which, bad):
    """An index outside the table fails the launch (the kernel traps) rather than reading another row or memory past
    the table; a subprocess, since the trap poisons its CUDA context."""
    done = subprocess.run([sys.executable, "-c", _TRAP, which, str(bad)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
