"""rotary_matrix: the matrix-form rotary of Kandinsky 5's and 6's processors (``apply_rotary(x, rope)``: float32
products of 2x2 rotation matrices and the pairs, aten's sum of each row's two, one rounding), exact by construction:
bit-exact on the GPU at their shapes (poisoned outputs, signed zeros and special values compared as bits), and on a
CPU the kernel's arithmetic, the guard, the rewriter's form and its proofs, the namespace's checks."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from diffusers.models.transformers import transformer_kandinsky, transformer_kandinsky6, transformer_kandinsky6_sr

from diffusers_fastpath.ops import Site, rotary_matrix, rotary_matrix_ref
from diffusers_fastpath.ops.rotary_matrix import ROTARY_MATRIX

DTYPES = [torch.bfloat16, torch.float16]
APPLY_ROTARY = transformer_kandinsky6.apply_rotary  # the model's own function


def _k5_apply_rotary():
    """The function Kandinsky5AttnProcessor.__call__ defines, compiled from its own source."""
    source = textwrap.dedent(inspect.getsource(transformer_kandinsky.Kandinsky5AttnProcessor.__call__))
    (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "apply_rotary"]
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<k5>", "exec"), vars(transformer_kandinsky), namespace)
    return namespace["apply_rotary"]


def matrix_inputs(lead, table_lead, heads, dim, dtype, device, seed):
    """``[*lead, H, D]`` activations with per-head scales over decades; float32 ``[*table_lead, 1, D/2, 2, 2]``
    rotation matrices of random angles, as the models' RoPE modules build them (``[[cos, -sin], [sin, cos]]``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*lead, heads, dim, generator=gen, device=device)
    x = (x * torch.exp(torch.randn(*lead, heads, 1, generator=gen, device=device))).to(dtype)
    angles = torch.rand(*table_lead, dim // 2, generator=gen, device=device) * 1000
    cos, sin = torch.cos(angles), torch.sin(angles)
    rope = torch.stack([cos, -sin, sin, cos], dim=-1).view(*table_lead, dim // 2, 2, 2).unsqueeze(-4)
    return x, rope


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # torch.equal takes -0 for +0; a user's md5 does not


# --- GPU: the contract ---------------------------------------------------------------------------------------

# (x's leading dims, the table's, heads, dim): Kandinsky 6 at 768x512x121 (4096 wide, 32 heads of 128; 31 x 32 x 48
# video tokens, its text), a batch of two; Kandinsky 5 Lite (2048 wide, head 64); odd small ones
MATRIX_CASES = [((1, 47616), (47616,), 32, 128), ((2, 1037), (1037,), 32, 128), ((1, 1024), (1024,), 32, 128),
                ((1, 9360), (9360,), 32, 64), ((3, 7), (7,), 3, 8), ((5,), (), 1, 2), ((2, 3, 4), (3, 4), 2, 6)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MATRIX_CASES, ids=str)
def test_rotary_matrix_matches_eager_bitwise(case, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in (0, 1):
        x, rope = matrix_inputs(*case, dtype, "cuda", seed)
        ref = APPLY_ROTARY(x, rope)
        poison = torch.full_like(ref, float("nan"))
        del poison  # its block is what the caching allocator hands the kernel's output next: NaN unless written
        site = Site("rotary_matrix")
        out = rotary_matrix(x, rope, site, APPLY_ROTARY)
        assert torch.equal(_bits(out), _bits(ref)) and out.is_contiguous() and out.shape == x.shape
        assert site.fast == 1 and not site.fallback
    assert ROTARY_MATRIX.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matrix_signed_zeros_and_special_values_bitwise(dtype):
    """Pairs whose two products are both -0 (aten's sum gives +0, a plain ``p0 + p1`` -0), zeros of either sign
    against every table sign, infinities, NaNs, the dtype's extremes and subnormals."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    finfo = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), finfo.max, -finfo.max,
                           finfo.tiny, -finfo.tiny, finfo.tiny / 4, 3.0e-3, -7.5])
    table = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, -2.0, float("inf"), float("nan"), 1e-30, 3.0e38])
    grid_x = torch.cartesian_prod(values, values)  # every (x0, x1)
    grid_m = torch.cartesian_prod(table, table)  # every row (m0, m1) of a matrix
    pairs, rows = grid_x.shape[0], grid_m.shape[0]
    x = grid_x.repeat(rows, 1).to(dtype).view(rows, 1, 2 * pairs).cuda()  # [rows, 1 head, pairs * 2]
    m = grid_m.repeat_interleave(pairs, 0).view(rows, pairs, 2)
    rope = torch.stack([m, m.flip(-1)], dim=-2).view(rows, 1, pairs, 2, 2).cuda()  # rows (m0, m1) and (m1, m0)
    ref = APPLY_ROTARY(x, rope)
    assert (_bits(ref) == _bits(torch.zeros((), dtype=dtype))).any()  # +0 from -0 + -0: the case is in the grid
    out = rotary_matrix(x, rope, Site("rotary_matrix"), APPLY_ROTARY)
    assert torch.equal(_bits(out), _bits(ref))
    assert torch.equal(_bits(torch.ops.diffusers_fastpath._rotary_matrix_cuda(x, rope.view(rows, -1))), _bits(ref))


@pytest.mark.gpu
def test_kandinsky5s_function_matches_on_the_gpu():
    x, rope = matrix_inputs((1, 9360), (9360,), 32, 64, torch.bfloat16, "cuda", 2)
    fn = _k5_apply_rotary()
    assert torch.equal(_bits(rotary_matrix(x, rope, None, fn)), _bits(fn(x, rope)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kandinsky6", "kandinsky6-sr", "kandinsky5"])
def test_zoo_models_run_the_fused_op_on_cuda(name):
    from test_generic_zoo import _check

    sites = [s for s in _check(name, "cuda") if s.op == "rotary_matrix"]
    assert sites and sum(s.fast for s in sites) > 0 and not any(s.fallback for s in sites), sites


@pytest.mark.gpu
def test_rotary_matrix_opcheck_cuda():
    x, rope = matrix_inputs((2, 13), (13,), 3, 64, torch.bfloat16, "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.rotary_matrix.default, (x, rope))


# --- CPU: the arithmetic, the guard ----------------------------------------------------------------------------


def kernel_arithmetic(x, rope):
    """csrc/rotary.cu's rotary_matrix_kernel per pair: float products, (0 + p0) + (0 + p1), one rounding."""
    p = rope * x.float().unflatten(-1, (-1, 1, 2))
    return ((0.0 + p[..., 0]) + (0.0 + p[..., 1])).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_arithmetic_is_the_models_functions_bit_for_bit(dtype):
    """Kandinsky 6's and its SR model's function, and Kandinsky 5's (bf16), are the kernel's arithmetic."""
    x, rope = matrix_inputs((2, 40), (40,), 4, 64, dtype, "cpu", 3)
    ref = APPLY_ROTARY(x, rope)
    assert torch.equal(ref, transformer_kandinsky6_sr.apply_rotary(x, rope))
    assert torch.equal(rotary_matrix_ref(x, rope), ref) and torch.equal(kernel_arithmetic(x, rope), ref)
    if dtype is torch.bfloat16:
        assert torch.equal(_k5_apply_rotary()(x, rope), ref)
    # where it is not ``p0 + p1``: a pair whose two products are -0 (aten's sum on CUDA: +0; the GPU test above)
    zeros = torch.tensor([-0.0, 0.0], dtype=dtype).view(1, 1, 2)
    rope = torch.tensor([[1.0, -1.0], [1.0, -1.0]]).view(1, 1, 1, 2, 2)  # both rows: -0 * 1 and +0 * -1
    p = rope * zeros.float().unflatten(-1, (-1, 1, 2))
    assert torch.equal(_bits(kernel_arithmetic(zeros, rope)), _bits(torch.zeros(1, 1, 2, dtype=dtype)))
    assert torch.equal(_bits((p[..., 0] + p[..., 1]).flatten(-2).to(dtype)), _bits(torch.full((1, 1, 2), -0.0, dtype=dtype)))


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("bf16_table", "rope dtype"),
        ("odd_dim", "shape"),
        ("batch_broadcast", "shape"),  # a table of its own leading 1 over a batch of 2
        ("per_head_table", "shape"),
        ("table_too_long", "shape"),
        ("strided", "strided"),
        ("requires_grad", "requires grad"),
        ("misaligned", "rope alignment"),
        ("cpu", "device cpu"),
    ],
)
def test_guard_refuses_with_reason_and_the_function_runs(case, reason, monkeypatch):
    x, rope = matrix_inputs((2, 6), (6,), 3, 16, torch.bfloat16, "cpu", 4)
    if case == "fp32":
        x = x.float()
    elif case == "bf16_table":
        rope = rope.bfloat16()
    elif case == "odd_dim":
        x = torch.cat([x, x[..., :1]], dim=-1)
    elif case == "batch_broadcast":
        rope = rope.unsqueeze(0)
    elif case == "per_head_table":
        rope = rope.expand(6, 3, 8, 2, 2).contiguous()
    elif case == "table_too_long":
        rope = torch.cat([rope, rope[:1]])
    elif case == "strided":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    elif case == "requires_grad":
        x = x.clone().requires_grad_()
    elif case == "misaligned":
        rope = torch.cat([torch.zeros(1), rope.flatten()])[1:].view(rope.shape)  # 4 bytes past a 16-byte boundary
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(ROTARY_MATRIX, "kernel", lambda *a: pytest.fail("the kernel ran"))
    site = Site("rotary_matrix")
    with torch.set_grad_enabled(case == "requires_grad"):
        out = rotary_matrix(x, rope, site, APPLY_ROTARY) if case not in ("odd_dim", "table_too_long") else None
        if out is None:  # (the model's function cannot take these shapes: the reference expression raises too)
            assert ROTARY_MATRIX.guard(x, rope) == reason
            return
        ref = APPLY_ROTARY(x, rope)
    assert torch.equal(out, ref) and site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_custom_op_opcheck_cpu():
    x, rope = matrix_inputs((2, 5), (5,), 3, 8, torch.bfloat16, "cpu", 6)
    op = torch.ops.diffusers_fastpath.rotary_matrix.default
    torch.library.opcheck(op, (x, rope))
    assert torch.equal(op(x, rope), APPLY_ROTARY(x, rope))


# --- the rewriter's form -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, taken",
    [
        ("query = apply_rotary(query, rotary_emb).to(dtype=query.dtype)", 1),  # Kandinsky 6
        ("query = apply_rotary(query, rotary_emb)", 1),  # its SR model
        ("query = apply_rotary(query, rotary_emb).type_as(query)", 1),  # Kandinsky 5 (its own function)
        ("q, k = (apply_rotary(q, r), apply_rotary(k, r))", 2),
        ("query = apply_rotary(query.x, rotary_emb)", 0),  # not plain names
        ("query = apply_rotary(query, rope=rotary_emb)", 0),  # a keyword
        ("query = apply_rotary(query, rotary_emb, 1)", 0),
        ("query = rotate(query, rotary_emb)", 0),  # a name not known as the function
        ("apply_rotary(query, rotary_emb)", 0),  # not an assignment
    ],
)
def test_the_form_is_taken_only_as_written(source, taken):
    from diffusers_fastpath.models._chain_rotary_matrix import matrix_calls

    stmt = ast.parse(source).body[0]
    new, count = matrix_calls(stmt, "attn", frozenset({"apply_rotary"}), frozenset())
    assert count == taken and (new is not stmt) == bool(taken)
    if taken:
        text = ast.unparse(ast.fix_missing_locations(new))
        assert text.count(".rotary_matrix(apply_rotary, ") == taken and "_fastpath_site_rotary_matrix" in text


def _module_forward():  # its globals: this module's, where the name below is Kandinsky 6's function
    pass


apply_rotary = APPLY_ROTARY


def test_known_names_are_read_from_the_forward_and_its_module():
    """Kandinsky 6's function by its module's name; Kandinsky 5's by the forward's one definition of it; a name
    bound again, decorated, or of another source is neither."""
    from diffusers_fastpath.models._chain_rotary_matrix import known_names

    k5 = textwrap.dedent(inspect.getsource(transformer_kandinsky.Kandinsky5AttnProcessor.__call__))
    k5_def = next(n for n in ast.walk(ast.parse(k5)) if isinstance(n, ast.FunctionDef) and n.name == "apply_rotary")
    local = textwrap.indent(ast.unparse(k5_def).replace("def apply_rotary", "def own_rotary"), "    ")

    def names(body: str):
        tree = ast.parse(f"def forward(q, r):\n{local}\n{body}\n").body[0]
        return known_names(_module_forward, tree)

    assert names("    return apply_rotary(q, r) + own_rotary(q, r)") == ({"apply_rotary"}, {"own_rotary"})
    assert names("    apply_rotary = len\n    own_rotary = len\n    return apply_rotary(q, r)") == (set(), set())
    assert names("    for own_rotary in ():\n        pass\n    return own_rotary(q, r)") == (set(), set())
    decorated = ast.parse(f"def forward(q, r):\n    @staticmethod\n{local}\n    return own_rotary(q, r)\n").body[0]
    assert known_names(_module_forward, decorated) == (set(), set())
    other = ast.parse("def forward(q, r):\n    def own_rotary(x, rope):\n        return x\n    return own_rotary(q, r)\n")
    assert known_names(_module_forward, other.body[0]) == (set(), set())


def test_only_the_known_function_is_fused(emulated_kernels):
    """The namespace runs the fused op for Kandinsky 6's function and for the proven local one on bfloat16 only (its
    result is bfloat16); any other function, or operands that are not tensors, as written."""
    from diffusers_fastpath.models._chain_calls import _ChainsNamespace
    from diffusers_fastpath.models._chain_rotary_matrix import is_matrix_rotary

    assert is_matrix_rotary(APPLY_ROTARY) and is_matrix_rotary(transformer_kandinsky6_sr.apply_rotary)

    def other(x, rope):  # another function of the same call shape: runs as written
        return x + 1

    assert not is_matrix_rotary(other) and not is_matrix_rotary(len)
    x, rope = matrix_inputs((2, 6), (6,), 3, 16, torch.bfloat16, "cpu", 8)
    site = Site("rotary_matrix")
    assert torch.equal(_ChainsNamespace.rotary_matrix(other, x, rope, site, False), x + 1) and site.fast == 0
    assert torch.equal(_bits(_ChainsNamespace.rotary_matrix(APPLY_ROTARY, x, rope, site, False)),
                       _bits(APPLY_ROTARY(x, rope))) and site.fast == 1
    k5 = _k5_apply_rotary()
    assert torch.equal(_ChainsNamespace.rotary_matrix(k5, x, rope, site, True), k5(x, rope)) and site.fast == 2
    half = x.half()
    out = _ChainsNamespace.rotary_matrix(k5, half, rope, site, True)  # Kandinsky 5's result is bf16: as written
    assert out.dtype is torch.bfloat16 and torch.equal(out, k5(half, rope)) and site.fast == 2 and not site.fallback
