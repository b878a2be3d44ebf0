"""rmsnorm_scale_shift / gated_rmsnorm_scale_shift (ERNIE-Image) and rmsnorm_scale / rmsnorm_gated_residual (the
sandwich norms of Z-Image and Lumina2): bit-exact on GPU at the families' shapes with the fast path verified, and
their guards, self-verification and fallbacks everywhere."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from diffusers_fastpath.ops import (
    Site,
    gated_rmsnorm_scale_shift,
    gated_rmsnorm_scale_shift_ref,
    rmsnorm_gated_residual,
    rmsnorm_gated_residual_ref,
    rmsnorm_scale,
    rmsnorm_scale_ref,
    rmsnorm_scale_shift,
    rmsnorm_scale_shift_ref,
)
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.rmsnorm_scale_shift import (GATED_RMSNORM_SCALE_SHIFT, RMSNORM_GATED_RESIDUAL, RMSNORM_SCALE,
                                                        RMSNORM_SCALE_SHIFT, _rms_norm)

# [seq, batch, dim] as ErnieImageSharedAdaLNBlock sees them: 1024x1024 (4096 image + 120 text tokens), a CFG
# batch at 512x512, and a 2048-wide row.
ERNIE_SHAPES = [(4216, 1, 4096), (1140, 2, 4096), (128, 1, 2048)]
DTYPES = [torch.bfloat16, torch.float16]


def random_norm(dim, eps, dtype, device, seed):
    """A draw of fresh random tensors (``rnd(*shape, std=...)``) and a diffusers RMSNorm whose weights are around 1,
    not ones (every product is exercised), from one generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=gen, device=device) * std).to(dtype)  # noqa: E731
    norm = RMSNorm(dim, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + rnd(dim, std=0.1))
    norm.weight.requires_grad_(False)
    return rnd, norm


def make_inputs(shape, dtype, device, seed):
    """x, scale, shift and gate laid out as the block has them, and the attention output permuted back from
    [batch, seq, dim] (strided for batch > 1), with a random-weight RMSNorm."""
    seq, batch, dim = shape
    rnd, norm = random_norm(dim, 1e-6, dtype, device, seed)
    x = rnd(seq, batch, dim, std=3.0)
    rows = lambda: rnd(1, batch, dim).expand(seq, -1, -1).contiguous()  # noqa: E731  (the model's expanded rows)
    scale, shift, gate = rows(), rows(), rows()
    update = rnd(batch, seq, dim).permute(1, 0, 2)
    return norm, x, scale, shift, gate, update


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ERNIE_SHAPES, ids=str)
def test_rmsnorm_scale_shift_matches_eager_bitwise_and_verifies(shape, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    for seed in range(2):  # fresh inputs each round
        norm, x, scale, shift, gate, update = make_inputs(shape, dtype, "cuda", seed)
        ref = rmsnorm_scale_shift_ref(norm, x, scale, shift)
        out = torch.full_like(x, float("nan"))  # poisoned
        ops._rmsnorm_scale_shift_cuda_out(out, x, norm.weight, scale, shift, norm.eps)
        assert torch.equal(out, ref)

        ref_res, ref_out = gated_rmsnorm_scale_shift_ref(norm, x, gate, update, scale, shift)
        res_out, out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        ops._gated_rmsnorm_scale_shift_cuda_out(res_out, out, x, gate, update, norm.weight, scale, shift, norm.eps)
        assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)

        site, gated_site = Site("rmsnorm_scale_shift"), Site("gated_rmsnorm_scale_shift")
        assert torch.equal(rmsnorm_scale_shift(norm, x, scale, shift, site), ref)
        got_res, got_out = gated_rmsnorm_scale_shift(norm, x, gate, update, scale, shift, gated_site)
        assert torch.equal(got_res, ref_res) and torch.equal(got_out, ref_out)
        # the fast path really ran, verified itself and stayed enabled
        assert site.fast == 1 and gated_site.fast == 1 and not site.fallback and not gated_site.fallback
    for op in (RMSNORM_SCALE_SHIFT, GATED_RMSNORM_SCALE_SHIFT):
        assert op.disabled is None and (str(dtype).removeprefix("torch."), shape[2]) in op.verified


@pytest.mark.gpu
def test_rmsnorm_opcheck_cuda():
    norm, x, scale, shift, gate, update = make_inputs((64, 2, 1024), torch.bfloat16, "cuda", 0)
    ops = torch.ops.diffusers_fastpath
    torch.library.opcheck(ops.rmsnorm_scale_shift.default, (x, norm.weight, scale, shift, norm.eps))
    torch.library.opcheck(ops.gated_rmsnorm_scale_shift.default, (x, gate, update, norm.weight, scale, shift, norm.eps))


# --- CPU: reference, guards, self-verification ------------------------------------------------------------------


def test_functional_reference_is_diffusers_rmsnorm():
    norm, x, *_ = make_inputs((40, 2, 768), torch.bfloat16, "cpu", 0)
    assert torch.equal(_rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("short_rows", "D outside the reproduced reduction"),
        ("few_rows", "fewer than 16 rows"),
        ("strided_x", "x not contiguous"),
        ("strided_scale", "operands strided or mismatched"),
        ("no_weight", "norm without weight or with bias"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_guard_falls_back_with_reason(case, reason, monkeypatch):
    shape = (8, 1, 768) if case == "few_rows" else (40, 2, 512 if case == "short_rows" else 768)
    norm, x, scale, shift, gate, update = make_inputs(shape, torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x, scale, shift = norm.float(), x.float(), scale.float(), shift.float()
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "strided_scale":
        scale = torch.cat([scale, scale], dim=2)[..., ::2]
    elif case == "no_weight":
        norm = RMSNorm(768, eps=1e-6, elementwise_affine=False)
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("rmsnorm_scale_shift")
    assert torch.equal(rmsnorm_scale_shift(norm, x, scale, shift, site), rmsnorm_scale_shift_ref(norm, x, scale, shift))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_ernie_layouts_pass_the_guard(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for shape in [(40, 1, 768), (40, 2, 2048)]:
        norm, x, scale, shift, gate, update = make_inputs(shape, torch.bfloat16, "cpu", 0)
        assert RMSNORM_SCALE_SHIFT.guard(norm, x, scale, shift) is None
        assert GATED_RMSNORM_SCALE_SHIFT.guard(norm, x, gate, update, scale, shift) is None


@pytest.fixture
def guard_open(monkeypatch):
    for op in (RMSNORM_SCALE_SHIFT, GATED_RMSNORM_SCALE_SHIFT):
        monkeypatch.setattr(op, "guard", lambda *a, **k: None)


def test_a_kernel_that_is_not_bit_exact_is_disabled_and_eager_returned(guard_open, monkeypatch, fastpath_log):
    def off_by_one_ulp(norm, x, scale, shift):
        out = rmsnorm_scale_shift_ref(norm, x, scale, shift)
        return (out.view(torch.int16) + 1).view(out.dtype)  # wrong in the last bit everywhere

    monkeypatch.setattr(RMSNORM_SCALE_SHIFT, "kernel", off_by_one_ulp)
    norm, x, scale, shift, *_ = make_inputs((40, 1, 768), torch.bfloat16, "cpu", 2)
    ref = rmsnorm_scale_shift_ref(norm, x, scale, shift)
    site = Site("rmsnorm_scale_shift")
    for _ in range(3):
        assert torch.equal(rmsnorm_scale_shift(norm, x, scale, shift, site), ref)
    assert "not bit-exact against this platform's eager result for ('bfloat16', 768)" in RMSNORM_SCALE_SHIFT.disabled
    assert not RMSNORM_SCALE_SHIFT.verified and site.fast == 0
    assert dict(site.fallback) == {_policy.REASON_DISABLED: 3}
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'rmsnorm_scale_shift'" in r.getMessage()]
    assert len(warnings) == 1 and "not bit-exact" in warnings[0].getMessage()


def test_a_bit_exact_kernel_is_verified_once_per_signature(guard_open, monkeypatch):
    calls = {"ref": 0}
    real_ref = GATED_RMSNORM_SCALE_SHIFT.ref

    def counting_ref(*args):
        calls["ref"] += 1
        return real_ref(*args)

    monkeypatch.setattr(GATED_RMSNORM_SCALE_SHIFT, "ref", counting_ref)
    monkeypatch.setattr(GATED_RMSNORM_SCALE_SHIFT, "kernel", real_ref)  # exact by construction
    site = Site("gated_rmsnorm_scale_shift")
    for seed in range(3):
        norm, x, scale, shift, gate, update = make_inputs((40, 2, 768), torch.bfloat16, "cpu", seed)
        gated_rmsnorm_scale_shift(norm, x, gate, update, scale, shift, site)
    assert calls["ref"] == 1 and site.fast == 3  # verified on the first call only
    assert GATED_RMSNORM_SCALE_SHIFT.verified == {("bfloat16", 768)}
    assert GATED_RMSNORM_SCALE_SHIFT.status == "enabled, verified for bfloat16/768"


def test_unverified_signatures_stay_eager_under_compile(guard_open, monkeypatch):
    monkeypatch.setattr(RMSNORM_SCALE_SHIFT, "custom_op", lambda *a: (_ for _ in ()).throw(AssertionError("emitted")))
    norm, x, scale, shift, *_ = make_inputs((40, 1, 768), torch.bfloat16, "cpu", 3)
    fn = torch.compile(lambda *a: rmsnorm_scale_shift(*a), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(norm, x, scale, shift), rmsnorm_scale_shift_ref(norm, x, scale, shift))


@pytest.mark.parametrize("batch", [1, 2])
def test_custom_ops_opcheck_cpu(batch):
    norm, x, scale, shift, gate, update = make_inputs((24, batch, 768), torch.bfloat16, "cpu", 0)
    ops = torch.ops.diffusers_fastpath
    torch.library.opcheck(ops.rmsnorm_scale_shift.default, (x, norm.weight, scale, shift, norm.eps))
    torch.library.opcheck(ops.gated_rmsnorm_scale_shift.default, (x, gate, update, norm.weight, scale, shift, norm.eps))
    res, out = ops.gated_rmsnorm_scale_shift(x, gate, update, norm.weight, scale, shift, norm.eps)
    ref_res, ref_out = gated_rmsnorm_scale_shift_ref(norm, x, gate, update, scale, shift)
    assert torch.equal(res, ref_res) and torch.equal(out, ref_out)


# --- the sandwich norms (Z-Image, Lumina2): rmsnorm_scale and rmsnorm_gated_residual -----------------------------

# [batch, seq, dim] as ZImageTransformerBlock sees them: 1024x1024 (4096 image + 512 caption tokens), a batch of two
# (4096 + 128 padded), Lumina2's 2304-wide rows, and a short sequence.
SANDWICH_SHAPES = [(1, 4608, 3840), (2, 4224, 3840), (1, 4352, 2304), (2, 33, 1024)]


def make_sandwich_inputs(shape, dtype, device, seed, per_token=False):
    """x (the norm input), residual, and scale/gate rows ``[batch, 1, dim]`` (or full per-token ``[batch, seq, dim]``,
    Z-Image's omni mode), with a random-weight RMSNorm (weights around 1, not ones: every product is exercised)."""
    batch, seq, dim = shape
    rnd, norm = random_norm(dim, 1e-5, dtype, device, seed)
    rows = (batch, seq if per_token else 1, dim)
    x, residual = rnd(batch, seq, dim, std=3.0), rnd(batch, seq, dim)
    scale, gate = 1 + rnd(*rows, std=0.3), rnd(*rows, std=0.5).tanh()
    return norm, x, residual, scale, gate


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [False, True], ids=["rows", "per_token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SANDWICH_SHAPES, ids=str)
def test_sandwich_norms_match_eager_bitwise_and_verify(shape, dtype, per_token):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    ops = torch.ops.diffusers_fastpath
    for seed in range(2):  # fresh inputs each round
        norm, x, residual, scale, gate = make_sandwich_inputs(shape, dtype, "cuda", seed, per_token)
        ref = rmsnorm_scale_ref(norm, x, scale)
        out = torch.full_like(x, float("nan"))  # poisoned
        ops._rmsnorm_scale_cuda_out(out, x, norm.weight, scale.expand_as(x), norm.eps)
        assert torch.equal(out, ref)
        ref_res = rmsnorm_gated_residual_ref(norm, residual, gate, x)
        out = torch.full_like(x, float("nan"))
        ops._rmsnorm_gated_residual_cuda_out(out, residual, gate.expand_as(x), x, norm.weight, norm.eps)
        assert torch.equal(out, ref_res)

        site, gated_site = Site("rmsnorm_scale"), Site("rmsnorm_gated_residual")
        assert torch.equal(rmsnorm_scale(norm, x, scale, site), ref)
        assert torch.equal(rmsnorm_gated_residual(norm, residual, gate, x, gated_site), ref_res)
        assert site.fast == 1 and gated_site.fast == 1 and not site.fallback and not gated_site.fallback
    for op in (RMSNORM_SCALE, RMSNORM_GATED_RESIDUAL):
        assert op.disabled is None and (str(dtype).removeprefix("torch."), shape[2]) in op.verified


@pytest.mark.gpu
def test_sandwich_norms_opcheck_cuda():
    norm, x, residual, scale, gate = make_sandwich_inputs((2, 64, 1024), torch.bfloat16, "cuda", 0)
    ops = torch.ops.diffusers_fastpath
    torch.library.opcheck(ops.rmsnorm_scale.default, (x, norm.weight, scale, norm.eps))
    torch.library.opcheck(ops.rmsnorm_gated_residual.default, (residual, gate, x, norm.weight, norm.eps))


@pytest.mark.parametrize("per_token", [False, True], ids=["rows", "per_token"])
def test_sandwich_layouts_pass_the_guard(per_token, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for shape in [(1, 40, 768), (2, 40, 3840)]:
        norm, x, residual, scale, gate = make_sandwich_inputs(shape, torch.bfloat16, "cpu", 0, per_token)
        assert RMSNORM_SCALE.guard(norm, x, scale) is None
        assert RMSNORM_GATED_RESIDUAL.guard(norm, residual, gate, x) is None


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("fp32_scale", "operands strided or mismatched"),
        ("short_rows", "D outside the reproduced reduction"),
        ("scale_other_batch", "operands strided or mismatched"),
        ("strided_x", "x not contiguous"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
        ("python_scalars", "operand not a tensor"),
        ("torch_rmsnorm", "norm not diffusers' RMSNorm"),
        ("weight_shape", "norm weight shape"),
    ],
)
def test_sandwich_guards_fall_back_with_reason(case, reason, monkeypatch):
    shape = (2, 40, 512 if case == "short_rows" else 768)
    norm, x, residual, scale, gate = make_sandwich_inputs(shape, torch.bfloat16, "cpu", 1)
    if case == "fp32":
        norm, x, residual, scale, gate = norm.float(), x.float(), residual.float(), scale.float(), gate.float()
    elif case == "fp32_scale":
        scale, gate = scale.float(), gate.float()  # eager promotes the product to fp32; the kernel stays out
    elif case == "scale_other_batch":
        scale, gate = scale[:1].expand(3, 1, -1), gate[:1].expand(3, 1, -1)
    elif case == "python_scalars":
        scale, gate = 0.5, 0.25  # Python numbers: eager takes them; the guards refuse them without raising
    elif case == "torch_rmsnorm":  # torch's own RMSNorm computes in another order: its numbers differ
        norm = torch.nn.RMSNorm(768, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    elif case == "weight_shape":  # a [1] weight: eager broadcasts it over the row, the kernel would read [D]
        norm = RMSNorm(1, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
    elif case == "strided_x":
        x = torch.cat([x, x], dim=2)[..., ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site, gated_site = Site("rmsnorm_scale"), Site("rmsnorm_gated_residual")
    if case == "scale_other_batch":  # eager cannot broadcast these either: the same error both ways
        with pytest.raises(RuntimeError):
            rmsnorm_scale_ref(norm, x, scale)
        with pytest.raises(RuntimeError):
            rmsnorm_scale(norm, x, scale, site)
        assert dict(site.fallback) == {reason: 1}
        return
    assert torch.equal(rmsnorm_scale(norm, x, scale, site), rmsnorm_scale_ref(norm, x, scale))
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}
    got = rmsnorm_gated_residual(norm, residual, gate, x, gated_site)
    ref = rmsnorm_gated_residual_ref(norm, residual, gate, x)
    assert torch.equal(got, ref) and got.dtype == ref.dtype
    assert gated_site.fast == 0 and dict(gated_site.fallback) == {reason: 1}


def test_only_diffusers_rmsnorm_and_the_fastpath_swap_take_the_kernel(monkeypatch):
    """The kernel computes diffusers' RMSNorm from the norm's weight and eps without calling it: a subclass with a
    forward of its own (here one that scales its output) runs as written, counted; diffusers' class, this package's
    FastpathRMSNorm (diffusers' numbers, fused) and the custom ops' stand-in pass the guard."""
    from diffusers_fastpath.models._qk_norms import FastpathRMSNorm
    from diffusers_fastpath.ops.rmsnorm_scale_shift import _Norm

    class Doubled(RMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    norm, x, residual, scale, gate = make_sandwich_inputs((2, 40, 768), torch.bfloat16, "cpu", 4)
    doubled = Doubled(768, eps=norm.eps).to(torch.bfloat16).requires_grad_(False)
    doubled.load_state_dict(norm.state_dict())
    site = Site("rmsnorm_scale")
    assert torch.equal(rmsnorm_scale(doubled, x, scale, site), doubled(x) * scale)
    assert site.fast == 0 and dict(site.fallback) == {"norm not diffusers' RMSNorm": 1}
    assert RMSNORM_SCALE.guard(norm, x, scale) is None
    assert RMSNORM_SCALE.guard(_Norm(norm.weight, norm.eps), x, scale) is None
    norm.__class__ = FastpathRMSNorm  # as the generic path swaps it
    assert RMSNORM_SCALE.guard(norm, x, scale) is None


def test_sandwich_gated_residual_falls_back_to_the_fused_gated_residual(monkeypatch):
    """Where the norm cannot run fused, the norm runs as written and the gated residual after it is still the exact
    fused `gated_residual`."""
    import sys

    mod = sys.modules["diffusers_fastpath.ops.rmsnorm_scale_shift"]  # the package exports a function of that name
    calls = []
    monkeypatch.setattr(mod, "gated_residual", lambda r, g, u: calls.append(u.shape) or r + g * u)
    norm, x, residual, scale, gate = make_sandwich_inputs((1, 40, 512), torch.bfloat16, "cpu", 2)
    got = rmsnorm_gated_residual(norm, residual, gate, x, Site("rmsnorm_gated_residual"))
    assert torch.equal(got, rmsnorm_gated_residual_ref(norm, residual, gate, x)) and calls == [x.shape]


def test_a_sandwich_kernel_that_is_not_bit_exact_is_disabled(monkeypatch, fastpath_log):
    monkeypatch.setattr(RMSNORM_SCALE, "guard", lambda *a, **k: None)

    def off_by_one_ulp(norm, x, scale):
        out = rmsnorm_scale_ref(norm, x, scale)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(RMSNORM_SCALE, "kernel", off_by_one_ulp)
    norm, x, residual, scale, gate = make_sandwich_inputs((1, 40, 768), torch.bfloat16, "cpu", 3)
    site = Site("rmsnorm_scale")
    for _ in range(2):
        assert torch.equal(rmsnorm_scale(norm, x, scale, site), rmsnorm_scale_ref(norm, x, scale))
    assert "not bit-exact" in RMSNORM_SCALE.disabled and site.fast == 0
    assert dict(site.fallback) == {_policy.REASON_DISABLED: 2}


@pytest.mark.parametrize("per_token", [False, True], ids=["rows", "per_token"])
def test_sandwich_custom_ops_opcheck_cpu(per_token):
    norm, x, residual, scale, gate = make_sandwich_inputs((2, 24, 768), torch.bfloat16, "cpu", 0, per_token)
    ops = torch.ops.diffusers_fastpath
    torch.library.opcheck(ops.rmsnorm_scale.default, (x, norm.weight, scale, norm.eps))
    torch.library.opcheck(ops.rmsnorm_gated_residual.default, (residual, gate, x, norm.weight, norm.eps))
    assert torch.equal(ops.rmsnorm_scale(x, norm.weight, scale, norm.eps), rmsnorm_scale_ref(norm, x, scale))
    assert torch.equal(ops.rmsnorm_gated_residual(residual, gate, x, norm.weight, norm.eps),
                       rmsnorm_gated_residual_ref(norm, residual, gate, x))
