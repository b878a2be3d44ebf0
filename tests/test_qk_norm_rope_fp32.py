"""qk_norm_rope_fp32: FLUX.3's QK norm and rotary in float32, cast back (``norm_q(q.float())``, ``apply_rotary_emb``
in float32, ``.to(value.dtype)``) as one kernel that rounds once: bit-exact on the GPU at FLUX.3's shapes with the fast
path verified; on a CPU the formula, the guards, the verification, the rewriter's cast proof and FLUX.3's processor
and zoo model with the kernel emulated. And qk_norm_rope_zero_centred, Krea 2's float32 ``Krea2RMSNorm`` (scale
``1 + weight``, the norm cast back) before the rotary in x's dtype: the same kernel with the norm rounded."""

from __future__ import annotations

import ast
import sys

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from test_rotary import activations, rope_tables

from diffusers_fastpath.ops import Site, qk_norm_rope_fp32, qk_norm_rope_fp32_ref
from diffusers_fastpath.ops.qk_norm_rope_fp32 import QK_NORM_ROPE_FP32

DTYPES = [torch.bfloat16, torch.float16]


def fp32_norm(dim, device, gen, eps=1e-6):
    """FLUX.3's QK norm: ``torch.nn.RMSNorm(dim)`` kept in float32 (``_keep_in_fp32_modules``)."""
    norm = torch.nn.RMSNorm(dim, eps=eps, device=device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=gen, device=device))
    return norm.requires_grad_(False)


def fp32_inputs(batch, seq, heads, dim, dtype, device, seed, strided=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = fp32_norm(dim, device, gen)
    x = activations((batch, seq, heads, dim), dtype, device, gen, strided)
    cos, sin = rope_tables(seq, dim, device, seed)
    return norm, x, cos, sin


# --- GPU: the contract ---------------------------------------------------------------------------------------

# (batch, seq, heads, dim): FLUX.3 at 1024x1024 (3072 wide, 24 heads of 128): the image mode blocks' 4096 tokens, the
# joint blocks' 160 text + 4096 image tokens, a CFG batch of odd length; head_dim 64 (the generic rotary_kernel)
FP32_CASES = [(1, 4096, 24, 128), (1, 4256, 24, 128), (2, 1037, 24, 128), (1, 160, 24, 128), (2, 33, 5, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FP32_CASES, ids=str)
def test_qk_norm_rope_fp32_matches_eager_bitwise_and_verifies(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed, strided in [(0, False), (1, True)]:  # the second a view of a fused qkv projection
        norm, x, cos, sin = fp32_inputs(*case, dtype, "cuda", seed, strided)
        ref = qk_norm_rope_fp32_ref(norm, x, cos, sin)
        assert ref.dtype is dtype and torch.isfinite(ref).all() and ref.float().std() > 0.1
        poison = torch.full_like(ref, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        raw = torch.ops.diffusers_fastpath._qk_norm_rope_fp32_cuda(x, norm.weight, norm.eps, cos, sin, False)
        assert torch.equal(raw, ref)
        site = Site("qk_norm_rope_fp32")
        assert torch.equal(qk_norm_rope_fp32(norm, x, cos, sin, site), ref)
        assert site.fast == 1 and not site.fallback  # the fused path ran, verified itself and stayed enabled
    assert QK_NORM_ROPE_FP32.disabled is None
    assert (str(dtype).removeprefix("torch."), case[3], "fp32 norm") in QK_NORM_ROPE_FP32.verified


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_fp32_special_values_bitwise(dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    norm, x, cos, sin = fp32_inputs(1, 64, 4, 128, dtype, "cuda", 7)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, info.tiny / 4, info.max], dtype=dtype, device="cuda")
    rows = torch.rand(1, 64, 4, 1, generator=gen, device="cuda") < 0.2  # some heads hold a special value
    x = torch.where(rows & (torch.rand(x.shape, generator=gen, device="cuda") < 0.05),
                    specials[torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")], x)
    x[0, 3] = 0  # an all-zero row: rstd of eps alone
    cos[::7, ::5], sin[3::11, 1::3] = -0.0, float("inf")
    ref = qk_norm_rope_fp32_ref(norm, x, cos, sin)
    assert ref.isnan().any()
    out = torch.ops.diffusers_fastpath._qk_norm_rope_fp32_cuda(x, norm.weight, norm.eps, cos, sin, False)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
def test_flux3_zoo_model_runs_the_fused_op_on_cuda():
    """FLUX.3 (tiny, bf16) patched on the GPU: equal to unpatched, every float32 QK-norm site fast."""
    from test_generic_zoo import _check

    sites = _check("flux3", "cuda")
    fp32 = [s for s in sites if s.op == "qk_norm_rope_fp32"]
    assert fp32 and all(s.fast == 4 and not s.fallback for s in fp32), fp32


@pytest.mark.gpu
def test_qk_norm_rope_fp32_opcheck_cuda():
    norm, x, cos, sin = fp32_inputs(2, 13, 3, 128, torch.bfloat16, "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.qk_norm_rope_fp32.default, (x, norm.weight, norm.eps, cos, sin))


# --- CPU: the formula, the guard, the verification -----------------------------------------------------------


def kernel_arithmetic(norm, x, cos, sin):
    """csrc/rotary.cu's kHeadNormF32 after the norm: the float32 norm (aten's order: the same reduction as the GPU's
    for these exactly upcast values), then per pair two float32 products and one sum, one rounding to x's dtype."""
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), norm.weight, norm.eps)
    a, b = y[..., 0::2], y[..., 1::2]
    c, s = cos[None, :, None], sin[None, :, None]
    even = a * c[..., 0::2] + (-b) * s[..., 0::2]
    odd = b * c[..., 1::2] + a * s[..., 1::2]
    return torch.stack([even, odd], dim=-1).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_formula_is_the_flux3_chain_bit_for_bit(dtype):
    """One rounding at the end is the eager chain; rounding the norm's result to x's dtype first (`qk_norm_rope`'s
    form, which the float32 chain does not have) is not."""
    norm, x, cos, sin = fp32_inputs(2, 40, 3, 64, dtype, "cpu", 3)
    ref = qk_norm_rope_fp32_ref(norm, x, cos, sin)
    with torch.no_grad():
        chain = apply_rotary_emb(norm(x.float()), (cos, sin), sequence_dim=1).to(dtype)  # the processor's lines
    assert torch.equal(ref, chain) and torch.equal(kernel_arithmetic(norm, x, cos, sin), ref)
    rounded_first = apply_rotary_emb(norm(x.float()).to(dtype), (cos, sin), sequence_dim=1)
    assert not torch.equal(rounded_first, ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32_x", "dtype float32"),
        ("weight_bf16", "norm weight dtype differs"),
        ("dim_256", "D outside the reproduced reduction"),
        ("odd_dim", "D outside the reproduced reduction"),
        ("strided_x", "x strided"),
        ("requires_grad", "requires grad"),
        ("tables_fp64", "cos/sin not float32"),
        ("tables_requiring_grad", "requires grad"),
        ("hooked", "RMSNorm has hooks"),  # the policy refuses a hooked module before the guard
        ("cpu", "device cpu"),
    ],
)
def test_guard_refuses_with_reason_and_the_eager_chain_runs(case, reason, monkeypatch):
    norm, x, cos, sin = fp32_inputs(1, 12, 2, 16, torch.bfloat16, "cpu", 4)
    if case == "fp32_x":
        x = x.float()
    elif case == "weight_bf16":
        norm = norm.to(torch.bfloat16)
    elif case == "dim_256":
        norm, x, cos, sin = fp32_inputs(1, 12, 2, 256, torch.bfloat16, "cpu", 4)
    elif case == "odd_dim":
        norm, x, cos, sin = fp32_inputs(1, 12, 2, 18, torch.bfloat16, "cpu", 4)
    elif case == "strided_x":
        x = torch.randn(1, 12, 2, 18).to(torch.bfloat16)[..., 1:17]
    elif case == "requires_grad":
        norm.weight.requires_grad_(True)
    elif case == "tables_fp64":
        cos, sin = cos.double(), sin.double()
    elif case == "tables_requiring_grad":  # eager's result records their gradient, the kernel's nothing
        sin = sin.clone().requires_grad_()
    elif case == "hooked":
        norm.register_forward_hook(lambda m, i, o: o)
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(QK_NORM_ROPE_FP32, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("qk_norm_rope_fp32")
    with torch.set_grad_enabled(case in ("requires_grad", "tables_requiring_grad")):
        out = qk_norm_rope_fp32(norm, x, cos, sin, site)
        ref = qk_norm_rope_fp32_ref(norm, x, cos, sin)
    assert torch.equal(out, ref) and site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_a_kernel_that_is_not_bit_exact_is_disabled_and_eager_runs(monkeypatch, fastpath_log):
    monkeypatch.setattr(QK_NORM_ROPE_FP32, "guard", lambda *a, **k: None)

    def off_by_one_ulp(*args):
        out = qk_norm_rope_fp32_ref(*args)
        return (out.view(torch.int16) + 1).view(out.dtype)

    monkeypatch.setattr(QK_NORM_ROPE_FP32, "kernel", off_by_one_ulp)
    norm, x, cos, sin = fp32_inputs(2, 11, 2, 16, torch.bfloat16, "cpu", 5)
    ref = qk_norm_rope_fp32_ref(norm, x, cos, sin)
    site = Site("qk_norm_rope_fp32")
    for _ in range(3):
        assert torch.equal(qk_norm_rope_fp32(norm, x, cos, sin, site), ref)
    assert "not bit-exact" in QK_NORM_ROPE_FP32.disabled and site.fast == 0


def test_custom_op_opcheck_cpu():
    norm, x, cos, sin = fp32_inputs(2, 11, 2, 16, torch.bfloat16, "cpu", 6)
    op = torch.ops.diffusers_fastpath.qk_norm_rope_fp32.default
    torch.library.opcheck(op, (x, norm.weight, norm.eps, cos, sin))
    assert torch.equal(op(x, norm.weight, norm.eps, cos, sin), qk_norm_rope_fp32_ref(norm, x, cos, sin))


# --- the rewriter's proof that the cast back follows ---------------------------------------------------------

_NS = "_diffusers_fastpath_chains"
_FLUX3 = f"""
query = {_NS}.norm_later_fp32(attn.norm_q, query)
key = {_NS}.norm_later_fp32(attn.norm_k, key)
if image_rotary_emb is not None:
    query = {_NS}.rotary(query, image_rotary_emb, s, q, r)
    key = {_NS}.rotary(key, image_rotary_emb, s, q, r)
query = {_NS}.materialize(query)
key = {_NS}.materialize(key)
{{cast}}
out = f(query, key, value)
"""


def _marked(cast: str, extra: str = "") -> int:
    from diffusers_fastpath.models._chain_qk_fp32 import mark_casts

    source = _FLUX3.format(cast=cast)
    if extra:
        source = source.replace("    key = _diffusers", f"    {extra}\n    key = _diffusers")
    body = ast.parse(source).body
    count = mark_casts(body, {"query", "key"}, "attn")
    rotaries = [n for n in ast.walk(ast.Module(body, [])) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", None) == "rotary"]
    assert sum(bool(n.keywords) for n in rotaries) == count  # each marked call: cast=..., fp32_site=...
    return count


@pytest.mark.parametrize(
    "cast, extra, marked",
    [
        ("query, key = query.to(value.dtype), key.to(value.dtype)", "", 2),  # FLUX.3's processor
        ("query = query.to(value.dtype)", "", 1),
        ("query, key = query.to(value.dtype), key.to(query.dtype)", "", 0),  # two dtypes
        ("query, key = query.to(value.dtype), key.to(value.dtype)", "print(query)", 0),  # read in float32 between
        ("query, key = query.to(value.dtype), key.to(value.dtype)", "value = value.float()", 0),  # dtype rebound
        ("query, key = query.to(value.dtype), key.to(value.dtype)", "query = query * 2", 0),  # rebound between
        ("query, key = key.to(value.dtype), query.to(value.dtype)", "", 0),  # swapped: not a cast back of each
        ("query, key = query.float(), key.float()", "", 0),
    ],
)
def test_the_cast_back_is_proven_before_the_rotary_rounds(cast, extra, marked):
    assert _marked(cast, extra) == marked


def test_a_cast_not_right_after_the_rotary_is_not_taken():
    from diffusers_fastpath.models._chain_qk_fp32 import mark_casts

    source = _FLUX3.format(cast="x = 1\nquery, key = query.to(value.dtype), key.to(value.dtype)")
    assert mark_casts(ast.parse(source).body, {"query", "key"}, "attn") == 0


# --- FLUX.3's processor and model, the kernel emulated ---------------------------------------------------------


def test_flux3_zoo_model_is_exact_with_every_fp32_site_fast(emulated_kernels):
    from test_generic_zoo import _check

    sites = _check("flux3", "cpu")
    fp32 = [s for s in sites if s.op == "qk_norm_rope_fp32"]
    assert len(fp32) == 4 and all(s.fast == 4 and not s.fallback for s in fp32), fp32
    assert not any(s.op == "qk_norm_rope" for s in sites)
    assert all(s.fast == 0 and not s.fallback for s in sites if s.op == "rotary_emb")  # the float32 rotary: fused


def test_flux3_keeps_the_chain_as_written_where_its_norm_weights_are_bf16(emulated_kernels, unpatch_after):
    """``model.to(bf16)`` casts the kept-in-float32 norms too: the kernel refuses them (counted), exact either way."""
    import diffusers_fastpath as fp
    from diffusers_fastpath.testing import zoo

    model = zoo.build("flux3", dtype=torch.bfloat16, device="cpu").to(torch.bfloat16)
    kwargs = zoo.inputs("flux3", model)
    with torch.no_grad():
        ref = model(**kwargs)[0]
        fp.patch(model)
        unpatch_after(model)
        out = model(**kwargs)[0]
    assert torch.equal(out, ref)
    sites = [s for s in fp.report(model).sites if s.op == "qk_norm_rope_fp32"]
    assert sites and all(s.fast == 0 and set(s.reasons) == {"norm weight dtype differs"} for s in sites)


# --- Krea 2's zero-centred QK norm ---------------------------------------------------------------------------------

from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm  # noqa: E402

from diffusers_fastpath.ops import qk_norm_rope_zero_centred, qk_norm_rope_zero_centred_ref  # noqa: E402
from diffusers_fastpath.ops.qk_norm_rope_fp32 import QK_NORM_ROPE_ZERO_CENTRED  # noqa: E402


def krea_inputs(batch, seq, heads, dim, dtype, device, seed, strided=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = Krea2RMSNorm(dim, eps=1e-5).to(device)  # float32, as _keep_in_fp32_modules keeps it
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(dim, generator=gen, device=device))  # zero-centred: the scale is 1 + w
    x = activations((batch, seq, heads, dim), dtype, device, gen, strided)
    cos, sin = rope_tables(seq, dim, device, seed)
    return norm.requires_grad_(False), x, cos, sin


# (batch, seq, heads, dim): Krea 2 at 1024x1024 (6144 wide, GQA 48 q / 12 kv heads of 128, 4096 image tokens), a
# batch of two, head_dim 64 (the generic kernel)
KREA_CASES = [(1, 4096, 48, 128), (1, 4096, 12, 128), (2, 1037, 48, 128), (2, 33, 5, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", KREA_CASES, ids=str)
def test_qk_norm_rope_zero_centred_matches_eager_bitwise_and_verifies(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed, strided in [(0, False), (1, True)]:
        norm, x, cos, sin = krea_inputs(*case, dtype, "cuda", seed, strided)
        ref = qk_norm_rope_zero_centred_ref(norm, x, cos, sin)
        assert ref.dtype is dtype and torch.isfinite(ref).all() and ref.float().std() > 0.1
        poison = torch.full_like(ref, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        raw = torch.ops.diffusers_fastpath._qk_norm_rope_fp32_cuda(x, norm.weight + 1.0, norm.eps, cos, sin, True)
        assert torch.equal(raw, ref)
        site = Site("qk_norm_rope_zero_centred")
        assert torch.equal(qk_norm_rope_zero_centred(norm, x, cos, sin, site), ref)
        assert site.fast == 1 and not site.fallback
    assert QK_NORM_ROPE_ZERO_CENTRED.disabled is None


@pytest.mark.gpu
def test_krea2_zoo_model_runs_the_fused_op_on_cuda():
    from test_generic_zoo import _check

    sites = [s for s in _check("krea2", "cuda") if s.op == "qk_norm_rope_zero_centred"]
    assert sum(s.fast for s in sites) == 8 and not any(s.fallback for s in sites), sites


def test_the_zero_centred_kernel_formula_is_krea2s_chain(monkeypatch):
    """The kernel's float32 weight ``w + 1.0`` and rounded norm are Krea2RMSNorm's; and the norm rounded (unlike
    FLUX.3's) is what the rotary in x's dtype reads."""
    norm, x, cos, sin = krea_inputs(2, 40, 3, 64, torch.bfloat16, "cpu", 3)
    y = torch.nn.functional.rms_norm(x.float(), (64,), norm.weight + 1.0, norm.eps).to(x.dtype)
    ref = qk_norm_rope_zero_centred_ref(norm, x, cos, sin)
    assert torch.equal(apply_rotary_emb(y, (cos, sin), sequence_dim=1), ref)
    monkeypatch.setattr(QK_NORM_ROPE_ZERO_CENTRED, "guard", lambda *a, **k: None)
    launched = []
    module = sys.modules["diffusers_fastpath.ops.qk_norm_rope_fp32"]  # (the package's name is the op function)
    monkeypatch.setattr(module, "_launch", lambda *args: launched.append(args) or ref)
    assert torch.equal(qk_norm_rope_zero_centred(norm, x, cos, sin), ref)
    (xa, weight, eps, *_, round_norm), = launched
    assert xa is x and torch.equal(weight, norm.weight + 1.0) and eps == norm.eps and round_norm is True


@pytest.mark.parametrize("case, reason", [("weight_bf16", "norm weight dtype differs"), ("dim_256", "norm"),
                                          ("hooked", "Krea2RMSNorm has hooks"), ("cpu", "device cpu")])
def test_zero_centred_guard_refuses_with_reason(case, reason, monkeypatch):
    norm, x, cos, sin = krea_inputs(1, 12, 2, 16, torch.bfloat16, "cpu", 4)
    if case == "weight_bf16":
        norm = norm.to(torch.bfloat16)
    elif case == "dim_256":
        norm.dim = 256
    elif case == "hooked":
        norm.register_forward_hook(lambda m, i, o: o)
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(QK_NORM_ROPE_ZERO_CENTRED, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("qk_norm_rope_zero_centred")
    if case == "dim_256":  # the module itself refuses that call: the eager error, not a silent number
        with pytest.raises(RuntimeError):
            qk_norm_rope_zero_centred(norm, x, cos, sin, site)
        assert list(site.fallback) == ["norm not a zero-centred RMSNorm of head_dim"]
        return
    out = qk_norm_rope_zero_centred(norm, x, cos, sin, site)
    assert torch.equal(out, qk_norm_rope_zero_centred_ref(norm, x, cos, sin)) and site.fast == 0
    assert dict(site.fallback) == {reason: 1}


def test_only_krea2s_norm_is_taken_as_zero_centred():
    from diffusers_fastpath.models._chain_qk_fp32 import is_zero_centred

    norm = Krea2RMSNorm(16)
    assert is_zero_centred(norm) and not is_zero_centred(torch.nn.RMSNorm(16))

    class Other(Krea2RMSNorm):
        def forward(self, hidden_states):
            return hidden_states

    assert not is_zero_centred(Other(16))
    norm.forward = lambda h: h  # an instance forward of its own: not the checked code
    assert not is_zero_centred(norm)


def test_a_wrapped_or_replaced_class_forward_is_not_taken_as_zero_centred(monkeypatch):
    """A forward replaced on the class after a first check (a ``functools.wraps`` wrapper, whose
    ``inspect.getsource`` is the wrapped function's) is checked again, and refused: the wrapper runs."""
    import functools

    from diffusers_fastpath.models._chain_qk_fp32 import is_zero_centred

    original = Krea2RMSNorm.forward
    assert is_zero_centred(Krea2RMSNorm(16))  # checked, and cached for that forward

    @functools.wraps(original)
    def wrapper(self, hidden_states):
        return original(self, hidden_states)

    monkeypatch.setattr(Krea2RMSNorm, "forward", wrapper)
    assert not is_zero_centred(Krea2RMSNorm(16))
    monkeypatch.setattr(Krea2RMSNorm, "forward", original)
    assert is_zero_centred(Krea2RMSNorm(16))


def test_krea2_zoo_model_is_exact_with_its_qk_norms_fused(emulated_kernels):
    from test_generic_zoo import _check

    sites = [s for s in _check("krea2", "cpu") if s.op == "qk_norm_rope_zero_centred"]
    # the two blocks' self-attentions (q and k, two forwards); the text-fusion attentions get no table
    assert sorted(s.fast for s in sites) == [0, 0, 0, 0, 4, 4] and not any(s.fallback for s in sites), sites
