"""rotary_half: the rotate-half rotary written inline in the storage dtype (Ideogram 4's and Cosmos 3's processors,
``x * cos + rotate_half(x) * sin``), exact by construction: bit-exact on the GPU at their shapes (poisoned outputs,
special values), and on a CPU the kernel's arithmetic, the guards, the rewriter's form and the zoo models with the
kernel emulated."""

from __future__ import annotations

import ast

import pytest
import torch
from diffusers.models.transformers import transformer_cosmos3, transformer_ideogram4

from diffusers_fastpath.ops import Site, rotary_half, rotary_half_ref
from diffusers_fastpath.ops.rotary_half import ROTARY_HALF

DTYPES = [torch.bfloat16, torch.float16]
ROTATE_HALF = transformer_ideogram4._rotate_half  # the models' own function


def half_inputs(lead, heads, dim, dtype, device, seed):
    """``[*lead, H, D]`` activations with per-head scales over decades, ``[*lead, 1, D]`` tables of x's dtype: cos
    and sin of random angles (Ideogram 4's MRoPE and Cosmos 3's give such values)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*lead, heads, dim, generator=gen, device=device)
    x = (x * torch.exp(torch.randn(*lead, heads, 1, generator=gen, device=device))).to(dtype)
    angles = torch.rand(*lead, 1, dim, generator=gen, device=device) * 1000
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


# --- GPU: the contract ---------------------------------------------------------------------------------------

# (leading dims, heads, dim): Ideogram 4 at 1024x1024 (4608 wide, 18 heads of 256; 4096 image + 512 text tokens), a
# batch of two; Cosmos 3 packed tokens (4096 wide, GQA 32 q / 8 kv heads of 128); odd small ones
HALF_CASES = [((1, 4608), 18, 256), ((2, 1037), 18, 256), ((4352,), 32, 128), ((4352,), 8, 128), ((7,), 3, 8),
              ((2, 5), 1, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", HALF_CASES, ids=str)
def test_rotary_half_matches_eager_bitwise(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in (0, 1):
        x, cos, sin = half_inputs(*case, dtype, "cuda", seed)
        ref = rotary_half_ref(x, cos, sin, ROTATE_HALF)
        poison = torch.full_like(ref, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site = Site("rotary_half")
        out = rotary_half(x, cos, sin, site, ROTATE_HALF)
        assert torch.equal(out, ref) and out.is_contiguous()
        assert site.fast == 1 and not site.fallback
    assert ROTARY_HALF.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_half_special_values_bitwise(dtype):
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, cos, sin = half_inputs((64,), 4, 128, dtype, "cuda", 7)
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, info.tiny / 4, info.max, -1.0],
                            dtype=dtype, device="cuda")
    pick = torch.randint(0, len(specials), x.shape, generator=gen, device="cuda")
    x = torch.where(torch.rand(x.shape, generator=gen, device="cuda") < 0.3, specials[pick], x)
    cos[::7, :, ::5], sin[3::11, :, 1::3] = -0.0, float("inf")
    ref = rotary_half_ref(x, cos, sin, ROTATE_HALF)
    assert ref.isnan().any() and ref.isinf().any()
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # defines the raw op (this test may be the first of its process to need the kernels)
    out = torch.ops.diffusers_fastpath._rotary_half_cuda(x.view(64, 4, 128), cos.view(64, 128), sin.view(64, 128))
    assert torch.equal(out.view(torch.int16), ref.view(64, 4, 128).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ideogram4", "cosmos3"])
def test_zoo_models_run_the_fused_op_on_cuda(name):
    from test_generic_zoo import _check

    sites = [s for s in _check(name, "cuda") if s.op == "rotary_half"]
    assert sites and all(s.fast > 0 and not s.fallback for s in sites), sites


@pytest.mark.gpu
def test_rotary_half_opcheck_cuda():
    x, cos, sin = half_inputs((2, 13), 3, 64, torch.bfloat16, "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rotary_half.default, (x, cos, sin))


# --- CPU: the arithmetic, the guard ----------------------------------------------------------------------------


def kernel_arithmetic(x, cos, sin):
    """csrc/rotary.cu's rotate_half_kernel per element: each product rounded to x's dtype, then their sum."""
    half, xf, c, s = x.shape[-1] // 2, x.float(), cos.float(), sin.float()

    def r(t):
        return t.to(x.dtype).float()

    lo = r(r(xf[..., :half] * c[..., :half]) + r(-xf[..., half:] * s[..., :half]))
    hi = r(r(xf[..., half:] * c[..., half:]) + r(xf[..., :half] * s[..., half:]))
    return torch.cat([lo, hi], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_arithmetic_is_the_models_expression_bit_for_bit(dtype):
    """The three roundings are eager's; a fused product-sum rounded once (the FLUX form) is not."""
    x, cos, sin = half_inputs((3, 40), 4, 64, dtype, "cpu", 3)
    ref = rotary_half_ref(x, cos, sin, ROTATE_HALF)
    assert torch.equal(ref, x * cos + transformer_cosmos3._rotate_half(x) * sin)
    assert torch.equal(kernel_arithmetic(x, cos, sin), ref)
    once = (x.float() * cos.float() + ROTATE_HALF(x).float() * sin.float()).to(dtype)
    assert not torch.equal(once, ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("fp32_tables", "cos/sin dtype differs"),
        ("odd_dim", "shape"),
        ("batch_broadcast", "shape"),
        ("per_head_tables", "shape"),
        ("strided", "strided"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
        ("python_scalar_tables", "operand not a tensor"),
    ],
)
def test_guard_refuses_with_reason_and_the_expression_runs(case, reason, monkeypatch):
    x, cos, sin = half_inputs((2, 6), 3, 16, torch.bfloat16, "cpu", 4)
    if case == "fp32":
        x, cos, sin = x.float(), cos.float(), sin.float()
    elif case == "fp32_tables":
        cos, sin = cos.float(), sin.float()
    elif case == "odd_dim":
        x, cos, sin = x[..., :15], cos[..., :15], sin[..., :15]
    elif case == "batch_broadcast":
        cos, sin = cos[:1], sin[:1]
    elif case == "per_head_tables":
        cos, sin = cos.expand(x.shape).contiguous(), sin.expand(x.shape).contiguous()
    elif case == "strided":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "python_scalar_tables":
        cos, sin = 0.5, 0.25  # Python numbers: eager takes them; the guard refuses them without raising
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(ROTARY_HALF, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("rotary_half")
    with torch.set_grad_enabled(case == "requires_grad"):
        out = rotary_half(x, cos, sin, site, ROTATE_HALF)
        ref = rotary_half_ref(x, cos, sin, ROTATE_HALF)
    assert torch.equal(out, ref) and site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_custom_op_opcheck_cpu():
    x, cos, sin = half_inputs((2, 5), 3, 8, torch.bfloat16, "cpu", 6)
    op = torch.ops.diffusers_fastpath.rotary_half.default
    torch.library.opcheck(op, (x, cos, sin))
    assert torch.equal(op(x, cos, sin), rotary_half_ref(x, cos, sin, ROTATE_HALF))


# --- the rewriter's form -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, taken",
    [
        ("q = (q * cos) + (_rotate_half(q) * sin)", True),  # Ideogram 4
        ("q_und = q_und * cos_und + _rotate_half(q_und) * sin_und", True),  # Cosmos 3
        ("q = q * cos + _rotate_half(k) * sin", False),  # another operand rotated
        ("q = q * cos + _rotate_half(q) * cos", False),  # one table twice
        ("q = q * cos - _rotate_half(q) * sin", False),
        ("q = _rotate_half(q) * sin + q * cos", False),  # another order of evaluation
        ("q = q * cos + rot.half(q) * sin", False),  # not a plain name
        ("q = q.x * cos + _rotate_half(q.x) * sin", False),
        ("q = q * cos + rotate(q) * sin", False),  # a name the module does not hold as the known function
    ],
)
def test_the_form_is_taken_only_as_written(source, taken):
    from diffusers_fastpath.models._chain_rotate_half import rotate_half_call

    new = rotate_half_call(ast.parse(source).body[0], "attn", frozenset({"_rotate_half"}))
    assert (new is not None) == taken
    if taken:
        assert ast.unparse(ast.fix_missing_locations(new)).split("(")[0].endswith("rotary_half")


def test_known_names_are_read_from_the_forwards_module():
    from diffusers_fastpath.models._chain_rotate_half import known_names
    from diffusers_fastpath._source import normalized_digest

    def forward(q, cos, sin):
        return _rotate_half(q) * sin + partial(q, cos, sin) + q.float()

    tree = ast.parse("def forward(q, cos, sin):\n    return _rotate_half(q) * sin + partial(q, cos, sin)\n").body[0]
    forward.__globals__  # noqa: B018 (this module's: _rotate_half and partial below are bound here)
    assert normalized_digest(ROTATE_HALF) in __import__(
        "diffusers_fastpath.models._chain_rotate_half", fromlist=["x"]).ROTATE_HALF_DIGESTS
    assert known_names(forward, tree) == (frozenset({"_rotate_half"}), frozenset({"partial"}))
    shadowed = ast.parse("def forward(q, cos, sin):\n    _rotate_half = len\n    return _rotate_half(q)\n").body[0]
    assert known_names(forward, shadowed) == (frozenset(), frozenset())


_rotate_half = ROTATE_HALF  # (for the test above: the module global a forward here would call)


def test_known_names_are_read_from_the_forwards_module():
    """The rotate-half and partial functions a forward calls, as its module holds them, unless it binds the name."""
    from diffusers_fastpath.models._chain_rotate_half import known_names

    calls = "_rotate_half(q) * sin + minimax_rope(q, cos, sin) + len(q)"
    tree = ast.parse(f"def forward(q, cos, sin):\n    return {calls}\n").body[0]
    assert known_names(_module_forward, tree) == (frozenset({"_rotate_half"}), frozenset({"minimax_rope"}))
    shadowed = ast.parse(f"def forward(q, cos, sin):\n    _rotate_half = len\n    return {calls}\n").body[0]
    assert known_names(_module_forward, shadowed) == (frozenset(), frozenset({"minimax_rope"}))


def _module_forward():  # its globals: this module's, where the names below are the models' functions
    pass


_rotate_half = ROTATE_HALF


def test_only_the_known_rotate_half_is_fused(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace
    from diffusers_fastpath.models._chain_rotate_half import is_rotate_half

    assert is_rotate_half(transformer_ideogram4._rotate_half) and is_rotate_half(transformer_cosmos3._rotate_half)

    def rotate_half_other(x):  # a different function of the same name shape: runs as written
        return torch.cat((x[..., 1:], x[..., :1]), dim=-1)

    assert not is_rotate_half(rotate_half_other) and not is_rotate_half(len)
    x, cos, sin = half_inputs((2, 6), 3, 16, torch.bfloat16, "cpu", 8)
    site = Site("rotary_half")
    out = _ChainsNamespace.rotary_half(rotate_half_other, x, cos, sin, site)
    assert torch.equal(out, x * cos + rotate_half_other(x) * sin) and site.fast == 0
    out = _ChainsNamespace.rotary_half(ROTATE_HALF, x, cos, sin, site)
    assert torch.equal(out, rotary_half_ref(x, cos, sin, ROTATE_HALF)) and site.fast == 1


# --- the zoo models, the kernel emulated ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, calls", [("ideogram4", 4), ("cosmos3", 10)])
def test_zoo_models_are_exact_with_every_rotary_half_site_fast(name, calls, emulated_kernels):
    from test_generic_zoo import _check

    sites = [s for s in _check(name, "cpu") if s.op == "rotary_half"]
    assert len(sites) == 2 and all(s.fast == calls and not s.fallback for s in sites), sites


# --- MiniMax-H3's partial form ---------------------------------------------------------------------------------------

from diffusers.models.transformers import transformer_minimax_h3  # noqa: E402

from diffusers_fastpath.ops import rotary_half_partial, rotary_half_partial_ref  # noqa: E402
from diffusers_fastpath.ops.rotary_half import ROTARY_HALF_PARTIAL  # noqa: E402

PARTIAL = transformer_minimax_h3._apply_rotary_emb  # the model's own function
minimax_rope = PARTIAL  # (for test_known_names_are_read_from_the_forwards_module)


def partial_inputs(batch, seq, heads, dim, rot_dim, dtype, device, seed, tables=torch.float32):
    """MiniMax-H3's operands: ``[B, S, H, D]`` activations and float32 ``[S, R]`` tables of its 3-axis rotary."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq, heads, dim, generator=gen, device=device)
    x = (x * torch.exp(torch.randn(batch, seq, heads, 1, generator=gen, device=device))).to(dtype)
    angles = torch.rand(seq, rot_dim, generator=gen, device=device) * 1000
    return x, angles.cos().to(tables), angles.sin().to(tables)


# (batch, seq, heads, head_dim, rot_dim): MiniMax-H3 (5376 wide, 42 heads of 128, 3 axes x 16 frequencies x 2 = 96
# rotated channels) at a 720p clip's ~8k tokens, a batch of two, the whole head rotated, odd small ones
PARTIAL_CASES = [(1, 8160, 42, 128, 96), (2, 517, 42, 128, 96), (1, 64, 4, 128, 128), (2, 7, 3, 10, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("tables", [torch.float32, None], ids=["fp32 tables", "tables of x's dtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PARTIAL_CASES, ids=str)
def test_rotary_half_partial_matches_minimax_bitwise(case, dtype, tables):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    x, cos, sin = partial_inputs(*case, dtype, "cuda", 0, tables or dtype)
    ref = PARTIAL(x, cos, sin)
    poison = torch.full_like(ref, float("nan"))
    del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
    site = Site("rotary_half_partial")
    assert torch.equal(rotary_half_partial(x, cos, sin, site, PARTIAL), ref)
    assert site.fast == 1 and not site.fallback


@pytest.mark.gpu
def test_zoo_minimax_runs_the_fused_op_on_cuda():
    from test_generic_zoo import _check

    sites = [s for s in _check("minimax-h3", "cuda") if s.op in ("rotary_half_partial", "qk_norm_rotary_half")]
    # (with its QK norms: the fused norm + rotary's site counts the calls, tests/test_qk_norm_rotary_half.py)
    assert sum(s.fast for s in sites) == 8 and not any(s.fallback for s in sites), sites


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tables", [torch.float32, None])
def test_the_partial_reference_and_arithmetic_are_minimax_bit_for_bit(dtype, tables):
    x, cos, sin = partial_inputs(2, 9, 3, 16, 10, dtype, "cpu", 2, tables or dtype)
    ref = PARTIAL(x, cos, sin)
    assert torch.equal(rotary_half_partial_ref(x, cos, sin), ref)  # the custom op's stand-in
    c, s = cos.to(dtype)[None, :, None, :], sin.to(dtype)[None, :, None, :]
    assert torch.equal(torch.cat([kernel_arithmetic(x[..., :10], c, s), x[..., 10:]], dim=-1), ref)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp64_tables", "cos/sin dtype"),
        ("odd_rot", "rotary dim odd or above head_dim"),
        ("wide_rot", "rotary dim odd or above head_dim"),
        ("seq", "shape"),
        ("strided", "strided"),
        ("cpu", "device cpu"),
    ],
)
def test_partial_guard_refuses_with_reason_and_the_function_runs(case, reason, monkeypatch):
    x, cos, sin = partial_inputs(2, 6, 3, 16, 10, torch.bfloat16, "cpu", 4)
    if case == "fp64_tables":
        cos, sin = cos.double(), sin.double()
    elif case == "odd_rot":
        cos, sin = cos[:, :9].contiguous(), sin[:, :9].contiguous()
    elif case == "wide_rot":
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif case == "seq":
        cos, sin = cos[:5], sin[:5]
    elif case == "strided":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(ROTARY_HALF_PARTIAL, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("rotary_half_partial")
    if case in ("seq", "wide_rot"):  # MiniMax-H3's function itself refuses these (broadcast, slice) or differs
        with pytest.raises(RuntimeError):
            rotary_half_partial(x, cos, sin, site, PARTIAL)
        assert dict(site.fallback) == {reason: 1}
        return
    out = rotary_half_partial(x, cos, sin, site, PARTIAL)
    assert torch.equal(out, PARTIAL(x, cos, sin)) and site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_partial_form_is_taken_only_for_the_known_function(emulated_kernels):
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace
    from diffusers_fastpath.models._chain_rotate_half import is_partial_rotate_half, partial_call

    names = frozenset({"_apply_rotary_emb", "f"})
    assert partial_call(ast.parse("q = _apply_rotary_emb(q, *rotary_emb)").body[0], "attn", names) is not None
    for source in ("q = f(q, *a, k=1)", "q = f(q, a)", "q = f(q.x, *a)", "q, k = f(q, *a)", "q = g(q, *a)"):
        assert partial_call(ast.parse(source).body[0], "attn", names) is None
    assert is_partial_rotate_half(PARTIAL) and not is_partial_rotate_half(ROTATE_HALF)
    x, cos, sin = partial_inputs(2, 6, 3, 16, 10, torch.bfloat16, "cpu", 5)
    site = Site("rotary_half_partial")

    def other(x, cos, sin):
        return x * 2

    assert torch.equal(_ChainsNamespace.rotary_half_partial(other, x, (cos, sin), site), x * 2) and site.fast == 0
    out = _ChainsNamespace.rotary_half_partial(PARTIAL, x, (cos, sin), site)
    assert torch.equal(out, PARTIAL(x, cos, sin)) and site.fast == 1


def test_zoo_minimax_is_exact_with_its_rotary_fast(emulated_kernels):
    from test_generic_zoo import _check

    sites = _check("minimax-h3", "cpu")
    rotary = [s for s in sites if s.op == "rotary_half_partial"]
    fused = [s for s in sites if s.op == "qk_norm_rotary_half"]
    # each call runs with its QK norm (`qk_norm_rotary_half`, tests/test_qk_norm_rotary_half.py), whose site counts it;
    # the token refiner's attention gets no rotary table: its sites count nothing
    assert sorted(s.fast for s in fused) == [0, 4, 4] and not any(s.fallback for s in fused), fused
    assert len(rotary) == 3 and not any(s.fast or s.fallback for s in rotary), rotary
