"""gelu_cat: the single block's tanh-GELU + concatenation, proven exact on every value on GPU; its guards, proof and
fallback policy everywhere; the FLUX single block's use of it."""

from __future__ import annotations

import importlib

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.models import flux as flux_adapter
from diffusers_fastpath.ops import Site, _policy, gelu_cat, gelu_cat_ref
from diffusers_fastpath.ops.gelu_cat import GELU_CAT, every_value
from diffusers_fastpath.testing import build_flux_transformer, flux_transformer_inputs

gelu_cat_module = importlib.import_module("diffusers_fastpath.ops.gelu_cat")  # the package exports the function

# FLUX.1-dev single blocks at 1024x1024 (4608 tokens) and 512x512 (1536), the CFG batch, an odd length, a small case
SHAPES = [(1, 4608, 3072, 12288), (1, 1536, 3072, 12288), (2, 1024, 3072, 12288), (1, 4097, 64, 256), (1, 17, 16, 64)]
DTYPES = [torch.bfloat16, torch.float16]


def make_inputs(shape, dtype, device, seed, attn_layout="contiguous"):
    """attn ``[B, S, Da]`` (contiguous, a column slice of a wider tensor, or the first S rows of a longer sequence:
    batches not evenly spaced) and the GELU's input ``[B, S, Dm]``, wide enough (x 4) to reach both of tanh's
    saturated tails."""
    b, s, da, dm = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    if attn_layout == "columns":
        attn = torch.randn(b, s, 2 * da, generator=gen, device=device).to(dtype)[..., da:]
    elif attn_layout == "rows":
        attn = torch.randn(b, s + 3, da, generator=gen, device=device).to(dtype)[:, 3:]
    else:
        attn = torch.randn(b, s, da, generator=gen, device=device).to(dtype)
    mlp = (torch.randn(b, s, dm, generator=gen, device=device) * 4).to(dtype)
    return attn, mlp


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_matches_eager_on_every_value_of_the_dtype(dtype):
    """The proof the op runs on its first call, spelled out: all 65536 bit patterns, NaNs and infinities included."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    values = every_value(dtype, "cuda")
    assert torch.unique(values.view(torch.int16)).numel() == 1 << 16
    attn = torch.randn(1, 8, 64, device="cuda").to(dtype)
    out = torch.full((1, 8, 64 + 8192), 1.2345, device="cuda", dtype=dtype)  # poisoned
    torch.ops.diffusers_fastpath._gelu_cat_cuda_out(out, attn, values)
    ref = gelu_cat_ref(attn, values)
    assert ref.isnan().any() and ref.isinf().any()
    mismatched = (out.view(torch.int16) != ref.view(torch.int16)).sum().item()
    assert mismatched == 0, f"{mismatched} of {ref.numel()} values differ from eager in their bits"


@pytest.mark.gpu
@pytest.mark.parametrize("attn_layout", ["contiguous", "columns", "rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_cat_matches_eager_bitwise(shape, dtype, attn_layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):  # fresh inputs each round
        attn, mlp = make_inputs(shape, dtype, "cuda", seed, attn_layout)
        ref = gelu_cat_ref(attn, mlp)
        out = torch.full_like(ref, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._gelu_cat_cuda_out(out, attn, mlp)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)

        site = Site("gelu_cat")
        got = gelu_cat(attn, mlp, site)
        assert site.fast == 1 and not site.fallback, site
        assert torch.equal(got, ref)
    assert GELU_CAT.disabled is None and GELU_CAT.verified == {(str(dtype).removeprefix("torch."),)}


@pytest.mark.gpu
def test_gelu_cat_cuda_guards_fall_back_exactly():
    attn, mlp = make_inputs((1, 64, 64, 256), torch.bfloat16, "cuda", 0)
    site = Site("gelu_cat")
    misaligned = torch.empty(mlp.numel() + 1, device="cuda", dtype=mlp.dtype)[1:].view_as(mlp).copy_(mlp)
    cases = [
        (attn, misaligned),
        (attn.float(), mlp.float()),
        (attn, torch.cat([mlp, mlp], dim=2)[..., ::2]),
        (attn, mlp.half()),
    ]
    for args in cases:
        assert torch.equal(gelu_cat(*args, site=site), gelu_cat_ref(*args))
    assert site.fast == 0
    assert dict(site.fallback) == {"not 16-byte aligned": 1, "dtype float32": 1, "rows strided": 1, "mixed dtypes": 1}


@pytest.mark.gpu
def test_gelu_cat_opcheck_cuda():
    torch.library.opcheck(torch.ops.diffusers_fastpath.gelu_cat.default, make_inputs((2, 33, 64, 128), torch.bfloat16, "cuda", 0))


@pytest.mark.gpu
def test_gelu_cat_under_torch_compile_fullgraph():
    attn, mlp = make_inputs((1, 512, 3072, 12288), torch.bfloat16, "cuda", 3)
    site = Site("gelu_cat")
    ref = gelu_cat_ref(attn, mlp)
    assert torch.equal(gelu_cat(attn, mlp, site), ref)  # eager: proves bfloat16
    compiled = torch.compile(lambda a, b: gelu_cat(a, b, site), fullgraph=True)
    assert torch.equal(compiled(attn, mlp), ref)


# --- CPU: guards, proof, fallback policy -------------------------------------------------------------------------


def test_every_value_is_every_bit_pattern():
    for dtype in DTYPES:
        values = every_value(dtype, "cpu")
        assert values.dtype == dtype and values.shape == (1, 8, 8192)
        assert torch.unique(values.view(torch.int16)).numel() == 1 << 16


def test_skipping_the_gelus_rounding_is_not_exact():
    """The contract is sensitive: the cat of an fp32 GELU rounded once is eager, a GELU computed in bf16 steps is
    not, on a large share of random inputs."""
    attn, mlp = make_inputs((1, 64, 16, 256), torch.bfloat16, "cpu", 0)
    x = mlp
    stepwise = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))  # every op rounded to bf16
    mismatch = (torch.cat([attn, stepwise], dim=2) != gelu_cat_ref(attn, mlp)).float().mean().item()
    assert mismatch > 0.05


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("mixed", "mixed dtypes"),
        ("rank", "shape"),
        ("seq", "shape"),
        ("odd_dim", "D not a multiple of 8"),
        ("empty", "empty"),
        ("mlp_strided", "rows strided"),
        ("attn_row_misaligned", "rows strided"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
        ("misaligned", "not 16-byte aligned"),
    ],
)
def test_guard_falls_back_with_reason(case, reason, monkeypatch):
    attn, mlp = make_inputs((2, 24, 16, 64), torch.bfloat16, "cpu", 1)
    if case == "fp32":
        attn, mlp = attn.float(), mlp.float()
    elif case == "mixed":
        mlp = mlp.half()
    elif case == "rank":
        attn, mlp = attn[0], mlp[0]
        attn, mlp = attn[None], mlp[None, :, None]  # [1, 24, 1, 64]: not [B, S, D]
    elif case == "seq":
        mlp = mlp[:, :12]
        attn = attn[:, :12].expand(2, 12, 16).contiguous()[:, :6]  # 6 rows against 12
    elif case == "odd_dim":
        attn = attn[..., :12].contiguous()
    elif case == "empty":
        attn, mlp = attn[:, :0], mlp[:, :0]
    elif case == "mlp_strided":
        mlp = torch.cat([mlp, mlp], dim=2)[..., ::2]
    elif case == "attn_row_misaligned":
        attn = torch.randn(2, 24, 20).to(attn.dtype)[..., :16]  # row stride 20: rows not 16-byte aligned
    elif case == "requires_grad":
        mlp = mlp.clone().requires_grad_()
    elif case == "misaligned":
        mlp = torch.empty(mlp.numel() + 1, dtype=mlp.dtype)[1:].view_as(mlp).copy_(mlp)
    if case != "cpu":
        # Make the device check pass on this CPU machine so that the structural check under test decides.
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("gelu_cat")
    if case in ("rank", "seq"):
        with pytest.raises(RuntimeError):
            gelu_cat_ref(attn, mlp)  # eager cannot concatenate these either: the same error reaches the caller
        assert GELU_CAT.guard(attn, mlp) == reason
        return
    ref = gelu_cat_ref(attn, mlp)
    out = gelu_cat(attn, mlp, site)
    assert torch.equal(out, ref)
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


@pytest.fixture
def guard_open(monkeypatch):
    monkeypatch.setattr(GELU_CAT, "guard", lambda *a, **k: None)


def _exact_except_at(value: float):
    """A kernel that is eager's GELU everywhere but one input value, which random inputs will not hit."""

    def kernel(attn, mlp):
        out = gelu_cat_ref(attn, mlp)
        hit = torch.cat([torch.zeros_like(attn, dtype=torch.bool), mlp == value], dim=2)
        return torch.where(hit, torch.zeros_like(out), out)

    return kernel


def test_the_proof_catches_a_value_that_the_first_call_does_not_see(guard_open, monkeypatch, fastpath_log):
    rare = float(torch.finfo(torch.bfloat16).max)
    monkeypatch.setattr(GELU_CAT, "kernel", _exact_except_at(rare))
    monkeypatch.setattr(gelu_cat_module, "_kernel", GELU_CAT.kernel)  # what the proof runs
    attn, mlp = make_inputs((1, 40, 16, 64), torch.bfloat16, "cpu", 0)
    assert not (mlp == rare).any() and torch.equal(GELU_CAT.kernel(attn, mlp), gelu_cat_ref(attn, mlp))
    site = Site("gelu_cat")
    assert torch.equal(gelu_cat(attn, mlp, site), gelu_cat_ref(attn, mlp))
    assert "not bit-exact against this platform's eager result for ('bfloat16',)" in GELU_CAT.disabled
    assert not GELU_CAT.verified and site.fast == 0 and dict(site.fallback) == {_policy.REASON_DISABLED: 1}
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'gelu_cat'" in r.getMessage()]
    assert len(warnings) == 1


def test_an_exact_kernel_is_proven_once_per_dtype(guard_open, monkeypatch):
    proofs = []
    real_prove = GELU_CAT.prove

    def counting_prove(attn, mlp):
        proofs.append(mlp.dtype)
        return real_prove(attn, mlp)

    monkeypatch.setattr(GELU_CAT, "kernel", gelu_cat_ref)  # exact by construction
    monkeypatch.setattr(gelu_cat_module, "_kernel", gelu_cat_ref)
    monkeypatch.setattr(GELU_CAT, "prove", counting_prove)
    site = Site("gelu_cat")
    for seed in range(3):
        gelu_cat(*make_inputs((1, 8, 16, 64), torch.bfloat16, "cpu", seed), site)
    gelu_cat(*make_inputs((1, 8, 16, 64), torch.float16, "cpu", 3), site)
    assert proofs == [torch.bfloat16, torch.float16] and site.fast == 4
    assert GELU_CAT.status == "enabled, verified for bfloat16, float16"


def test_a_proof_that_fails_falls_back_once_with_one_warning(guard_open, monkeypatch, fastpath_log):
    """The proof runs the kernel on every value of the dtype: where that raises (a launch failure, missing kernels),
    the call falls back to eager, the op is disabled with one warning, and nothing reaches the caller."""
    def failing_prove(attn, mlp):
        raise RuntimeError("injected failure in the proof")

    monkeypatch.setattr(GELU_CAT, "kernel", gelu_cat_ref)
    monkeypatch.setattr(GELU_CAT, "prove", failing_prove)
    site = Site("gelu_cat")
    for seed in range(2):
        attn, mlp = make_inputs((1, 8, 16, 64), torch.bfloat16, "cpu", seed)
        assert torch.equal(gelu_cat(attn, mlp, site), gelu_cat_ref(attn, mlp))
    assert GELU_CAT.disabled == "RuntimeError: injected failure in the proof" and site.fast == 0
    assert dict(site.fallback) == {_policy.REASON_DISABLED: 2}
    assert sum("disabling the fused op 'gelu_cat'" in r.getMessage() for r in fastpath_log.records) == 1


def test_nan_with_eagers_bits_is_not_a_mismatch():
    x = torch.tensor([1.0, float("nan"), -float("inf")], dtype=torch.bfloat16)
    assert not torch.equal(x, x.clone()) and _policy.tensors_equal(x, x.clone())
    other_nan = x.clone().view(torch.int16)
    other_nan[1] += 1  # another NaN payload: not the same bits
    assert not _policy.tensors_equal(x, other_nan.view(torch.bfloat16))
    assert not _policy.tensors_equal(x, x.float())


# --- the FLUX single block ----------------------------------------------------------------------------------------


def _sites(model):
    return {r.site: r for r in fp.report(model).sites if r.op == "gelu_cat"}


def test_every_single_block_has_a_gelu_cat_site_and_stays_exact(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=3)
    inputs = flux_transformer_inputs(model, grid=(4, 6), txt_tokens=7, seed=4)
    with torch.no_grad():
        ref = model(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        assert torch.equal(model(**inputs).sample, ref)
    sites = _sites(model)
    assert set(sites) == {f"single_transformer_blocks.{i}:gelu_cat" for i in range(len(model.single_transformer_blocks))}
    assert all(s.fallback == 1 and s.reasons == {"device cpu": 1} for s in sites.values())


def test_a_hooked_or_replaced_act_mlp_runs_as_diffusers_does(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=5)
    inputs = flux_transformer_inputs(model, grid=(4, 6), txt_tokens=7, seed=6)
    blocks = model.single_transformer_blocks
    blocks[1].act_mlp = torch.nn.GELU(approximate="none")  # before patching: that block gets no site
    seen = []
    with torch.no_grad():
        ref = model(**inputs).sample
        fp.patch(model)
        unpatch_after(model)
        blocks[0].act_mlp.register_forward_hook(lambda *a: seen.append(1))  # after patching: checked per call
        assert torch.equal(model(**inputs).sample, ref)
    assert seen == [1]  # the hook ran: the block took diffusers' own GELU
    sites = _sites(model)
    assert "single_transformer_blocks.1:gelu_cat" not in sites
    assert sites["single_transformer_blocks.0:gelu_cat"].reasons == {"act_mlp has hooks": 1}
    assert flux_adapter.gelu_cat_unfit(blocks[1].act_mlp) == "act_mlp is not torch.nn.GELU(approximate='tanh')"


def test_the_high_tier_takes_the_gelu_into_the_up_projection_instead(unpatch_after):
    model = build_flux_transformer("flux-tiny", torch.bfloat16, seed=7)
    inputs = flux_transformer_inputs(model, grid=(4, 6), txt_tokens=7, seed=8)
    fp.patch(model)
    unpatch_after(model)
    with torch.no_grad(), fp.quality(model, "high"):
        model(**inputs)
        assert all(s.fast == 0 and s.fallback == 0 for s in _sites(model).values())  # not called
    with torch.no_grad():
        model(**inputs)
    assert all(s.fallback == 1 for s in _sites(model).values())  # lossless again: called (CPU: falls back)
