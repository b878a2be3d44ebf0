"""Qwen-Image 2.1's in-block pair, ``H = H + G.tanh() * attn`` then ``self._modulate(self.img_norm2(H), mod2, mask)``,
as one kernel (`gated_layernorm_scale_rows`): the rewriter's join (`_norm_methods.gated_norm_methods`) and the forms
it leaves alone, the method (`gated_modulate_scale_rows`) with its sites and refusals (hooks on the norm, a tensor
gate, no mask, a guard's reason), the op's guard and fallback on a CPU (emulated kernels); on the GPU the raw kernel
through nvcc and NVRTC against eager at Qwen-Image 2.1's shapes (poisoned outputs) and the method at full width."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import textwrap

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (QwenImage21TransformerBlock,
                                                                   _select_modulation_rows)

import diffusers_fastpath as fp
from diffusers_fastpath._state import site_attr, sites_of
from diffusers_fastpath.models._chain_proofs import Proofs
from diffusers_fastpath.models._norm_methods import (LATER, gated_modulate_scale_rows, gated_norm_methods,
                                                     modulate_scale_rows, norm_method_hints)
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.gated_layernorm_scale_rows import (GATED_LAYERNORM_SCALE_ROWS, gated_layernorm_scale_rows,
                                                               gated_layernorm_scale_rows_ref)
from diffusers_fastpath.ops.selected_rows import SelectedRows, tanh_rows
from diffusers_fastpath.testing import zoo

gated_rows_mod = importlib.import_module("diffusers_fastpath.ops.gated_layernorm_scale_rows")
DTYPES = [torch.bfloat16, torch.float16]


# --- the rewriter's join --------------------------------------------------------------------------------------------

FORWARD = """
def forward(self, x, mod, mask, y):
    a, g = self._m(self.n1, x, mod, mask, _fastpath_lazy_gate=True)
    {before}
    x = ns.gated_residual_rows(x, ns.tanh_rows(g), y, site)
    b, h = self._m(self.n2, x, {args}, _fastpath_lazy_gate=True)
    {after}
    return x, b, h
"""


HANDLED = """
def forward(self, x, mod, mask, y):
    a, g = self._m(self.n1, x, mod, mask, _fastpath_lazy_gate=True)
    try:
        x = ns.gated_residual_rows(x, ns.tanh_rows(g), y, site)
        b, h = self._m(self.n2, x, mod, mask, _fastpath_lazy_gate=True)
    except ValueError:
        print(x)
        raise
    return x, b, h
"""


def _joined(before="pass", args="mod, mask", after="pass", handled=False, replace=("", "")):
    source = HANDLED if handled else FORWARD.format(before=before, args=args, after=after).replace(*replace)
    written = ast.parse(textwrap.dedent(source)).body[0]
    proofs = Proofs(written, {"self"})
    body = copy.deepcopy(written.body)
    proofs.tag(body)
    norms = gated_norm_methods(body, "_m", "ns", proofs)
    return norms, "\n".join(ast.unparse(s) for s in body)


def test_the_pair_is_joined():
    norms, text = _joined()
    assert norms == ["n2"]
    assert ("x, b, h = ns.gated_modulate_scale_rows(self, self.n2, x, ns.tanh_rows(g), y, site, mod, mask, "
            "_fastpath_lazy_gate=True)") in text
    assert "ns.gated_residual_rows" not in text


def test_the_pair_in_a_try_whose_handlers_do_not_read_the_stream_is_joined():
    norms, text = _joined(handled=True, replace=("", ""))
    assert norms == []
    source = HANDLED.replace("print(x)", "print(mod)")
    written = ast.parse(textwrap.dedent(source)).body[0]
    proofs = Proofs(written, {"self"})
    body = copy.deepcopy(written.body)
    proofs.tag(body)
    assert gated_norm_methods(body, "_m", "ns", proofs) == ["n2"]
    assert "x, b, h = ns.gated_modulate_scale_rows(" in ast.unparse(body[1])


@pytest.mark.parametrize("case", ["reads-h", "writes-residual", "writes-update", "other-input", "binds-h",
                                  "handler-reads-h", "starred"])
def test_the_pair_is_left_alone_where_the_join_could_change_a_value(case):
    kwargs = {"reads-h": dict(args="mod + x, mask"),  # the argument reads the new stream
              "writes-residual": dict(args="mod, mask if x.mul_(1) is None else mask"),  # ... writes what R holds
              "writes-update": dict(args="mod, mask if y.add_(1) is None else mask"),  # ... writes what E holds
              "other-input": dict(replace=("self.n2, x,", "self.n2, y,")),  # the norm's input is not the new stream
              "binds-h": dict(replace=("b, h = self._m(self.n2", "b, x = self._m(self.n2")),  # its result rebinds it
              "handler-reads-h": dict(handled=True),  # the handler would see the old stream
              "starred": dict(args="*(mod, mask)")}[case]
    norms, text = _joined(**kwargs)
    assert norms == [] and "gated_modulate_scale_rows" not in text, text


def test_the_qwen21_block_forward_is_joined_once():
    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    fp.patch(model)
    try:
        block = model.transformer_blocks[0]
        source = inspect.getsource(type(block).forward)
        assert source.count("gated_modulate_scale_rows(self, self.img_norm2, hidden_states, ") == 1
        assert "hidden_states, img_modulated2, img_gate2 = " in source
        assert source.count("gated_residual_rows(") == 1  # the FFN's update, read by nothing before the block's end
        assert type(block)._fastpath_rewrite.gated_norms == ["img_norm2"]
        for b in model.transformer_blocks:
            sites = dict(sites_of(b.img_norm2))
            assert sites["gated"].op == "gated_layernorm_scale_rows" and None in sites
            assert "gated" not in dict(sites_of(b.img_norm1))
    finally:
        fp.unpatch(model)
    assert not any(site_attr("gated") in b.img_norm2.__dict__ for b in model.transformer_blocks)


# --- the method and the op on a CPU (emulated kernels) -------------------------------------------------------------


def _block(dim=64, seed=0):
    torch.manual_seed(seed)
    block = QwenImage21TransformerBlock(dim, 2, dim // 2).to(torch.bfloat16).requires_grad_(False)
    assert norm_method_hints(type(block)) == (("_modulate", "scale_rows"),)
    return block


def _inputs(dim=64, batch=2, seq=24, seed=3, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    residual = (torch.randn(batch, seq, dim, generator=gen) * 3).to(dtype)
    update = torch.randn(batch, seq, dim, generator=gen).to(dtype)
    mod1 = torch.randn(batch + 1, 2 * dim, generator=gen).to(dtype)
    mod2 = torch.randn(batch + 1, 2 * dim, generator=gen).to(dtype)
    mask = torch.ones(seq, dtype=torch.bool)
    mask[:5] = False
    mask[seq // 2] = False
    return residual, update, mod1, mod2, mask


def _eager(block, residual, update, mod1, mod2, mask):
    _, gate1 = block._modulate(block.img_norm1(residual), mod1, mask)
    x = residual + gate1.tanh() * update
    normed, gate2 = block._modulate(block.img_norm2(x), mod2, mask)
    return x, normed, gate2


def _gate_read(gate):
    """The method's second gate as the block reads it, ``gate.tanh()``: a lazy gate (`SelectedRows`, its tanh taken at
    the method's call: `tanh_rows` returns it) through `tanh_rows`, written out; a tensor's tanh."""
    return tanh_rows(gate).materialize() if isinstance(gate, SelectedRows) else gate.tanh()


def _sites(block):
    sites = {"gated": Site("gated_layernorm_scale_rows"), "norm": Site("layernorm_scale_shift"),
             "gate": Site("gated_residual")}
    block.img_norm2.__dict__[site_attr("gated")] = sites["gated"]
    block.img_norm2.__dict__[site_attr()] = sites["norm"]
    return sites


def _call(block, residual, update, mod1, mod2, mask, sites, lazy=True, first=True):
    _, gate1 = modulate_scale_rows(block, block.img_norm1, residual, mod1, mask, _fastpath_lazy_gate=first)
    return gated_modulate_scale_rows(block, block.img_norm2, residual, tanh_rows(gate1), update, sites["gate"], mod2,
                                     mask, _fastpath_lazy_gate=lazy)


@pytest.mark.parametrize("lazy", [True, False])
def test_the_method_runs_one_kernel_and_counts_every_site(emulated_kernels, lazy):
    block, args = _block(), _inputs()
    sites = _sites(block)
    calls = []
    kernel = GATED_LAYERNORM_SCALE_ROWS.kernel
    GATED_LAYERNORM_SCALE_ROWS.kernel = lambda *a: calls.append(a) or kernel(*a)
    try:
        with torch.no_grad():
            ref = _eager(block, *args)
            x, normed, gate2 = _call(block, *args, sites, lazy)
    finally:
        GATED_LAYERNORM_SCALE_ROWS.kernel = kernel
    assert len(calls) == 1 and torch.equal(x, ref[0]) and torch.equal(normed, ref[1])
    assert isinstance(gate2, SelectedRows) == lazy
    assert torch.equal(_gate_read(gate2), ref[2].tanh()) and (tanh_rows(gate2) is gate2) == lazy
    assert {k: (s.fast, dict(s.fallback)) for k, s in sites.items()} == {"gated": (1, {}), "norm": (1, {}),
                                                                         "gate": (1, {})}
    assert sites["norm"].op == "layernorm_scale_rows"  # named after the op its part ran


def test_hooks_on_the_norm_refuse_and_run(emulated_kernels):
    block, args = _block(), _inputs()
    sites = _sites(block)
    seen = []
    handle = block.img_norm2.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        with torch.no_grad():
            ref = _eager(block, *args)
            seen.clear()
            x, normed, gate2 = _call(block, *args, sites)
    finally:
        handle.remove()
    assert torch.equal(x, ref[0]) and torch.equal(normed, ref[1]) and torch.equal(_gate_read(gate2), ref[2].tanh())
    assert seen == [1]  # the norm was called, once, as the model calls it
    assert sites["gated"].fast == 0 and sites["gated"].fallback == {"LayerNorm has hooks": 1}
    assert sites["gate"].fast == 1 and sites["norm"].fallback == {"LayerNorm has hooks": 1}


@pytest.mark.parametrize("case", ["tensor-gate", "no-mask", "fp32", "grad"])
def test_refusals_run_the_two_calls_as_before(emulated_kernels, case):
    block, (residual, update, mod1, mod2, mask) = _block(), _inputs()
    sites = _sites(block)
    if case == "fp32":
        block, residual, update, mod1, mod2 = block.float(), residual.float(), update.float(), mod1.float(), mod2.float()
    mask_arg = None if case == "no-mask" else mask
    if case == "no-mask":
        mod1, mod2 = mod1[:2], mod2[:2]
    with torch.set_grad_enabled(case == "grad"):
        if case == "grad":
            update.requires_grad_(True)
        _, gate1 = block._modulate(block.img_norm1(residual), mod1, mask_arg)
        x_ref = residual + gate1.tanh() * update
        ref = block._modulate(block.img_norm2(x_ref), mod2, mask_arg)
        if case in ("tensor-gate", "no-mask"):
            gate = gate1.tanh()
        else:
            _, lazy = modulate_scale_rows(block, block.img_norm1, residual, mod1, mask, _fastpath_lazy_gate=True)
            gate = tanh_rows(lazy)
        x, normed, gate2 = gated_modulate_scale_rows(block, block.img_norm2, residual, gate, update, sites["gate"],
                                                     mod2, mask_arg, _fastpath_lazy_gate=True)
    assert torch.equal(x, x_ref) and torch.equal(normed, ref[0])
    assert torch.equal(_gate_read(gate2), ref[1].tanh())
    reason = {"fp32": "dtype float32", "grad": "requires grad"}.get(case)
    assert sites["gated"].fast == 0 and dict(sites["gated"].fallback) == ({reason: 1} if reason else {})


def test_the_guard_never_raises_and_the_op_falls_back_to_eager(emulated_kernels):
    block, (residual, update, mod1, mod2, mask) = _block(), _inputs()
    gate = SelectedRows(_select_modulation_rows, mod1[:, :64], mask).tanh_rows()
    scale = SelectedRows(_select_modulation_rows, mod2[:, :64], mask)
    guard = GATED_LAYERNORM_SCALE_ROWS.guard
    assert guard(block.img_norm2, residual, gate, update, scale) is None
    assert guard(block.img_norm2, residual, mod1, update, scale) == "operand not a tensor"
    assert guard(block.img_norm2, residual[:, :20], gate, update[:, :20], scale) == "rows shape"
    assert guard(block.img_norm2, residual, gate, update[:, :20], scale) == "shape"
    assert guard(block.img_norm2, residual, gate, update, SelectedRows(_select_modulation_rows, mod2, mask)) == (
        "rows shape")
    assert guard(torch.nn.Identity(), residual, gate, update, scale) == "norm not a LayerNorm over the last dim"
    assert guard(block.img_norm2, residual, gate, update.half(), scale) == "mixed dtypes"
    site = Site("gated_layernorm_scale_rows")
    with torch.no_grad():
        ref = gated_layernorm_scale_rows_ref(block.img_norm2, residual, gate, update, scale)
        got = gated_layernorm_scale_rows(block.img_norm2, residual, gate, update, scale, site)
        assert all(map(torch.equal, got, ref)) and site.fast == 1
        # a tensor gate (the [B + 1, 1, D] rows broadcast over a batch of one): the two fused ops' fallbacks, exact
        gate_t = mod1[:1, None, :64].tanh()
        odd = gated_layernorm_scale_rows(block.img_norm2, residual[:1], gate_t, update[:1], scale, site)
        x_ref = residual[:1] + gate_t * update[:1]
        assert torch.equal(odd[0], x_ref)
    assert site.fallback == {"operand not a tensor": 1}


def test_zoo_model_rows_off_the_mask_run_as_before(emulated_kernels):
    """The tiny Qwen-Image 2.1 without a mask (causal_condition off): the rows are per sample, tensors; the joined call
    runs the two calls as before (no gated kernel, nothing counted on its site), patched == unpatched."""
    model = zoo.build("qwen-image-21", dtype=torch.bfloat16)
    model.register_to_config(causal_condition=False)
    kwargs = zoo.inputs("qwen-image-21", model)
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    fp.patch(model)
    try:
        with torch.no_grad():
            assert torch.equal(model(**kwargs)[0], ref)
        gated = [dict(sites_of(b.img_norm2))["gated"] for b in model.transformer_blocks]
        assert all(s.fast == 0 and not s.fallback for s in gated)
    finally:
        fp.unpatch(model)


# --- the GPU ------------------------------------------------------------------------------------------------------

SHAPES = [(1, 4352, 3072), (1, 4096, 3072), (2, 4352, 3072), (3, 77, 1024)]  # 1024² + text, cached, CFG, odd


def _gpu_case(shape, dtype, seed):
    b, s, d = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    residual = (torch.randn(b, s, d, generator=gen, device="cuda") * 3 + 1).to(dtype)
    update = torch.randn(b, s, d, generator=gen, device="cuda").to(dtype)
    mod = (torch.randn(b + 1, 4 * d, generator=gen, device="cuda") * 2).to(dtype)  # strided chunks, as the model's
    mask = torch.ones(s, dtype=torch.bool, device="cuda")
    mask[:min(256, s // 4)] = False
    mask[s // 2: s // 2 + 3] = False
    gate = SelectedRows(_select_modulation_rows, mod[:, d:2 * d], mask).tanh_rows()
    scale = SelectedRows(_select_modulation_rows, mod[:, 3 * d:], mask)
    return residual, gate, update, scale


def _poison(*refs):
    for ref in refs:  # freed at once: the caching allocator hands these NaN blocks to the kernel's outputs
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=ref.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_raw_kernel_matches_eager_bitwise_through_nvcc_and_nvrtc(shape, dtype):
    from diffusers_fastpath.ops import _build, _nvrtc

    _build.load_extension()
    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    norm = torch.nn.LayerNorm(shape[2], elementwise_affine=False, eps=1e-6).cuda()
    for seed in range(2):
        residual, gate, update, scale = _gpu_case(shape, dtype, seed)
        args = (residual, gate.table(), gate.index(), update, scale.table(), None, scale.index(), None, None, 1e-6)
        with torch.no_grad():
            ref = gated_layernorm_scale_rows_ref(norm, residual, gate, update, scale)
            torch.cuda.synchronize()
            _poison(*ref, *ref)
            raw = torch.ops.diffusers_fastpath._gated_layernorm_modulate_rows_cuda(*args)  # nvcc's where built
            _poison(*ref, *ref)
            nvrtc = gated_rows_mod._nvrtc_gated_rows(*args)  # the NVRTC cubin, launched directly
        for got in (raw, nvrtc):
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq", [4352, 4096])
@pytest.mark.parametrize("mode", [True, LATER], ids=["tanh-at-call", "later"])
def test_method_is_fast_and_verified_on_the_gpu(dtype, seq, mode):
    """Both lazy forms of the first gate: its tanh taken at the method's call (a table), and read later (`LATER`: the
    kernel takes the tanh of the modulation's rows itself, its tanh proven on every value first)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    block = _block(3072).cuda().to(dtype)
    sites = _sites(block)
    residual, update, mod1, mod2, mask = (t.cuda() for t in _inputs(3072, 1, seq, seed=5, dtype=dtype))
    mask[:256] = False
    with torch.no_grad():
        ref = _eager(block, residual, update, mod1, mod2, mask)
        torch.cuda.synchronize()
        _poison(ref[0], ref[1])
        x, normed, gate2 = _call(block, residual, update, mod1, mod2, mask, sites, lazy=mode, first=mode)
    assert torch.equal(x, ref[0]) and torch.equal(normed, ref[1]) and torch.equal(_gate_read(gate2), ref[2].tanh())
    assert sites["gated"].fast == 1 and not sites["gated"].fallback and GATED_LAYERNORM_SCALE_ROWS.disabled is None
    assert (str(dtype).removeprefix("torch."), 3072, "LayerNorm", False, "gated indexed rows", "scale only",
            "tanh in kernel" if mode == LATER else "") in GATED_LAYERNORM_SCALE_ROWS.verified
    if mode == LATER:  # the fold is proven where it is used; a tanh taken at the call needs no proof
        assert gated_rows_mod.TANH_FOLDED.results[(residual.device, dtype)] is True
