"""gated_residual: the bit-exact contract on GPU, and its guards and fallback policy everywhere."""

from __future__ import annotations

import pytest
import torch

from diffusers_fastpath.ops import Site, gated_residual, gated_residual_ref
from diffusers_fastpath.ops import _policy
from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL

# image, text and single-block streams of FLUX.1-dev at 1024x1024, CFG batch, an odd length, a small odd case
FLUX_SHAPES = [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 1024, 3072), (1, 4097, 3072), (1, 17, 64)]
DTYPES = [torch.bfloat16, torch.float16]
LAYOUTS = ["adaln_chunk", "single_chunk", "broadcast_row", "full", "full_strided"]


def make_inputs(shape, dtype, layout, device, seed):
    """residual, gate, update with the gate laid out as diffusers makes it ("adaln_chunk": ``gate_msa`` of
    ``emb.chunk(6, dim=1)``, unsqueezed; "single_chunk": of ``chunk(3)``), or as a full ``[B, L, D]`` gate
    (contiguous, or a column slice of a wider tensor)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, d = shape
    residual = (torch.randn(shape, generator=gen, device=device) * 4).to(dtype)
    update = (torch.randn(shape, generator=gen, device=device) * 4).to(dtype)
    if layout in ("adaln_chunk", "single_chunk"):
        chunks = 6 if layout == "adaln_chunk" else 3
        emb = torch.randn(b, chunks * d, generator=gen, device=device).to(dtype)
        gate = emb.chunk(chunks, dim=1)[2].unsqueeze(1)
    elif layout == "broadcast_row":  # one [1, 1, D] row for the whole batch
        gate = torch.randn(1, 1, d, generator=gen, device=device).to(dtype)
    elif layout == "full":
        gate = torch.randn(shape, generator=gen, device=device).to(dtype)
    else:  # "full_strided": [B, L, D] columns of a [B, L, 2D] tensor
        gate = torch.randn(b, l, 2 * d, generator=gen, device=device).to(dtype)[..., d:]
    return residual, gate, update


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FLUX_SHAPES, ids=str)
def test_gated_residual_matches_eager_bitwise(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):  # fresh inputs each round
        residual, gate, update = make_inputs(shape, dtype, layout, "cuda", seed)
        if layout == "adaln_chunk":
            assert gate.stride(0) == 6 * shape[2] and gate.shape == (shape[0], 1, shape[2])
        ref = gated_residual_ref(residual, gate, update)
        out = torch.full_like(residual, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._gated_residual_cuda_out(out, residual, gate, update)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)

        site = Site("gated_residual")
        got = gated_residual(residual, gate, update, site)
        assert site.fast == 1 and not site.fallback, site
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["adaln_chunk", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_special_values_match_eager_bitwise(dtype, layout):
    """inf, -inf, NaN, the largest finite value, subnormals and -0.0 in residual, gate and update: every element has
    the bits eager produces (overflow of the product, inf - inf, -0 + -0, subnormal products flushed or kept)."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    info = torch.finfo(dtype)
    special = torch.tensor(
        [float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.smallest_normal / 4,
         -info.smallest_normal / 8, info.smallest_normal, -0.0, 0.0, 1.0, -1.0],
        dtype=torch.float32,
    )
    gen = torch.Generator().manual_seed(0)
    pick = lambda *shape: special[torch.randint(len(special), shape, generator=gen)]  # noqa: E731
    mix = lambda t: torch.where(torch.rand(t.shape, generator=gen) < 0.3, pick(*t.shape), t)  # noqa: E731
    residual, gate, update = make_inputs((2, 64, 512), torch.float32, layout, "cpu", 1)
    residual, gate, update = (mix(t * 100).to(dtype).cuda() for t in (residual, gate.contiguous(), update))
    ref = gated_residual_ref(residual, gate, update)
    out = torch.full_like(residual, 1.2345)
    torch.ops.diffusers_fastpath._gated_residual_cuda_out(out, residual, gate, update)
    nan = ref.isnan()
    assert nan.any() and ref.isinf().any() and (ref == 0).any()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))


@pytest.mark.gpu
def test_gated_residual_cuda_guards_fall_back_exactly():
    residual, gate, update = make_inputs((1, 64, 256), torch.bfloat16, "adaln_chunk", "cuda", 0)
    site = Site("gated_residual")
    misaligned = torch.empty(residual.numel() + 1, device="cuda", dtype=residual.dtype)[1:].view_as(residual)
    misaligned.copy_(residual)
    strided = torch.cat([update, update], dim=2)[..., ::2]
    cases = [
        (misaligned, gate, update),
        (residual.float(), gate.float(), update.float()),
        (residual, gate, strided),
        (residual, gate.float(), update),
    ]
    for args in cases:
        assert torch.equal(gated_residual(*args, site=site), gated_residual_ref(*args))
    assert site.fast == 0
    assert dict(site.fallback) == {
        "not 16-byte aligned": 1, "dtype float32": 1, "residual/update not contiguous": 1, "mixed dtypes": 1
    }


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["adaln_chunk", "broadcast_row", "full"])
def test_gated_residual_opcheck_cuda(layout):
    args = make_inputs((2, 33, 128), torch.bfloat16, layout, "cuda", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.gated_residual.default, args)


@pytest.mark.gpu
def test_gated_residual_under_torch_compile_fullgraph():
    residual, gate, update = make_inputs((1, 512, 3072), torch.bfloat16, "adaln_chunk", "cuda", 3)
    site = Site("gated_residual")
    compiled = torch.compile(lambda a, b, c: gated_residual(a, b, c, site), fullgraph=True)
    assert torch.equal(compiled(residual, gate, update), gated_residual_ref(residual, gate, update))


# --- CPU: guards, reasons, fallback policy, custom op -----------------------------------------------------------


def test_skipping_a_rounding_point_is_not_exact():
    """The contract is sensitive: an FMA-contracted kernel (the product not rounded to bf16 before the add) changes
    a large share of the outputs on random data, so only a kernel that keeps both rounding points passes the GPU
    tests above."""
    residual, gate, update = make_inputs((1, 256, 256), torch.bfloat16, "adaln_chunk", "cpu", 0)
    contracted = torch.addcmul(residual.float(), gate.float(), update.float()).to(residual.dtype)
    mismatch = (contracted != gated_residual_ref(residual, gate, update)).float().mean().item()
    assert mismatch > 0.05


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("mixed", "mixed dtypes"),
        ("gate_token_scalar", "shape"),
        ("update_shape", "shape"),
        ("gate_python_scalar", "operand not a tensor"),
        ("odd_dim", "D not a multiple of 8"),
        ("empty", "empty"),
        ("residual_strided", "residual/update not contiguous"),
        ("update_strided", "residual/update not contiguous"),
        ("gate_strided", "gate strided"),
        ("gate_row_misaligned", "gate strided"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
        ("misaligned", "not 16-byte aligned"),
    ],
)
def test_guard_falls_back_with_reason(case, reason, monkeypatch):
    residual, gate, update = make_inputs((2, 24, 64), torch.bfloat16, "adaln_chunk", "cpu", 1)
    if case == "fp32":
        residual, gate, update = residual.float(), gate.float(), update.float()
    elif case == "mixed":
        gate = gate.float()  # eager promotes to float32; the kernel keeps one dtype
    elif case == "gate_token_scalar":
        gate = torch.randn(1, 24, 1).to(gate.dtype)  # one number per token, broadcast over D: the kernel takes rows
    elif case == "update_shape":
        update = update[:1]  # eager broadcasts it over the batch; the kernel takes one shape
    elif case == "gate_python_scalar":
        gate = 0.5  # ``x + 0.5 * y``: eager takes a Python number; the guard refuses it without raising
    elif case == "odd_dim":
        residual, update, gate = residual[..., :60].contiguous(), update[..., :60].contiguous(), gate[..., :60]
    elif case == "empty":
        residual, update = residual[:, :0], update[:, :0]
    elif case == "residual_strided":
        residual = torch.cat([residual, residual], dim=2)[..., ::2]  # a strided view made by slicing
    elif case == "update_strided":
        update = torch.cat([update, update], dim=1)[:, ::2]
    elif case == "gate_strided":
        gate = torch.randn(2, 1, 128).to(gate.dtype)[..., ::2]
    elif case == "gate_row_misaligned":
        gate = torch.randn(2, 1, 68).to(gate.dtype)[..., :64]  # row stride 68: rows not 16-byte aligned
    elif case == "requires_grad":
        update = update.clone().requires_grad_()
    elif case == "misaligned":
        residual = torch.empty(residual.numel() + 1, dtype=residual.dtype)[1:].view_as(residual).copy_(residual)
    if case != "cpu":
        # Make the device check pass on this CPU machine so that the structural check under test decides.
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    site = Site("gated_residual")
    ref = gated_residual_ref(residual, gate, update)
    out = gated_residual(residual, gate, update, site)
    assert torch.equal(out, ref)
    assert site.fast == 0 and dict(site.fallback) == {reason: 1}


def test_a_2d_gate_is_the_1_l_d_gate(monkeypatch):
    """A 2-D ``[L, D]`` gate (MiniMax-H3's ``gate.index_select(0, rows)``: a row per token) broadcasts against
    ``[B, L, D]`` as ``[1, L, D]`` does, and the op takes it so (a view, no copy); a ``[1, D]`` one and a 1-D ``[D]``
    one as ``[1, 1, D]``."""
    from diffusers_fastpath.ops.gated_residual import as_batch_rows

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for batch in (1, 2):
        residual, _, update = make_inputs((batch, 24, 64), torch.bfloat16, "full", "cpu", 4)
        for gate in (torch.randn(24, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16),
                     torch.randn(64).to(torch.bfloat16)):
            rows = as_batch_rows(gate, residual)
            assert rows.shape == (1,) * (3 - gate.dim()) + gate.shape and rows.data_ptr() == gate.data_ptr()
            assert GATED_RESIDUAL.guard(residual, rows, update) is None
            assert torch.equal(gated_residual_ref(residual, rows, update), gated_residual_ref(residual, gate, update))
    assert as_batch_rows(gate, gate) is gate  # (2-D residual: as it is)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_gate_of_one_value_per_sample_is_written_as_its_row(monkeypatch, dtype):
    """Bria FIBO 2's ``x + self.cross_attn_gate.tanh() * norm(out)`` with a ``zeros(1)`` parameter: a ``[1]`` gate
    (and ``[B or 1, 1, 1]`` ones) broadcast over D; the op takes it as its ``[B or 1, 1, D]`` row, the same value
    times each element, so the fused chain (fast, where it refused the 1-wide gate by shape before) and the eager
    expression agree bit for bit; a 0-dim gate (a scalar in type promotion) is left as it is."""
    from diffusers_fastpath.ops.gated_residual import as_batch_rows

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda t: 0)
    for batch in (1, 3):
        residual, _, update = make_inputs((batch, 24, 64), torch.bfloat16, "full", "cpu", 5)
        gates = [torch.randn(1), torch.randn(1, 1, 1), torch.randn(batch, 1, 1)]
        for gate in (g.to(dtype) for g in gates):
            rows = as_batch_rows(gate, residual)
            assert rows.shape == (gate.shape[0] if gate.dim() == 3 else 1, 1, 64) and rows.is_contiguous()
            gate_dtype = residual.dtype if dtype is torch.bfloat16 else torch.float32
            expected = None if gate_dtype is residual.dtype else "mixed dtypes"
            assert GATED_RESIDUAL.guard(residual, rows, update) == expected
            assert torch.equal(gated_residual_ref(residual, rows, update), gated_residual_ref(residual, gate, update))
    scalar = torch.tensor(0.5, dtype=torch.bfloat16)
    assert as_batch_rows(scalar, residual) is scalar
    trained = torch.randn(1, requires_grad=True)  # eager sums its gradient in one reduction: left as it is
    assert as_batch_rows(trained, residual).shape == (1, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["tokens", "row"])
@pytest.mark.parametrize("tokens, dim", [(4680, 5376), (4096, 3584), (77, 256)])
def test_gated_residual_low_dim_gates_match_eager_bitwise(tokens, dim, kind, dtype):
    """MiniMax-H3's gate rows chosen per token (``gate.index_select(0, rows)``, ``[L, D]``) at its width 5376, and a
    1-D ``[D]`` gate (a parameter's ``tanh()``: Bria FIBO 2's form, 3584 wide), as the kernel's ``[1, L or 1, D]``:
    every element of a NaN-poisoned output written, and the public entry fast."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    gen = torch.Generator(device="cuda").manual_seed(7)
    residual, update = (torch.randn(2, 1, tokens, dim, generator=gen, device="cuda").to(dtype))
    table = torch.randn(6, dim, generator=gen, device="cuda").to(dtype)
    gate = (table.index_select(0, torch.randint(0, 6, (tokens,), generator=gen, device="cuda")) if kind == "tokens"
            else table[2].tanh())
    ref = gated_residual_ref(residual, gate, update)
    out = torch.full_like(ref, float("nan"))
    torch.ops.diffusers_fastpath._gated_residual_cuda_out(out, residual, gate[(None,) * (3 - gate.dim())], update)
    assert torch.equal(out, ref)
    site = Site("gated_residual")
    got = gated_residual(residual, gate, update, site)
    assert torch.equal(got, ref) and site.fast == 1 and not site.fallback, site


def test_guard_reports_devices_that_differ(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    residual, gate, update = make_inputs((1, 8, 64), torch.bfloat16, "adaln_chunk", "cpu", 2)
    assert GATED_RESIDUAL.guard(residual, gate.to("meta"), update) == "devices differ"
    assert GATED_RESIDUAL.guard(residual, gate, update.to("meta")) == "devices differ"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 17, 64), (2, 24, 64), (2, 1, 64)], ids=str)
def test_flux_gate_layouts_pass_the_guard(layout, shape, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for dtype in DTYPES:
        residual, gate, update = make_inputs(shape, dtype, layout, "cpu", 0)
        assert GATED_RESIDUAL.guard(residual, gate, update) is None


def _failing_kernel(*args):
    raise RuntimeError("injected kernel failure")


def test_failing_kernel_warns_once_disables_and_stays_exact(monkeypatch, fastpath_log):
    monkeypatch.setattr(GATED_RESIDUAL, "guard", lambda *a, **k: None)
    monkeypatch.setattr(GATED_RESIDUAL, "kernel", _failing_kernel)
    site = Site("gated_residual")
    residual, gate, update = make_inputs((1, 8, 64), torch.bfloat16, "adaln_chunk", "cpu", 2)
    for _ in range(3):
        assert torch.equal(gated_residual(residual, gate, update, site), gated_residual_ref(residual, gate, update))
    warnings = [r for r in fastpath_log.records if "disabling the fused op 'gated_residual'" in r.getMessage()]
    assert len(warnings) == 1 and "injected kernel failure" in warnings[0].getMessage()
    assert GATED_RESIDUAL.disabled == "RuntimeError: injected kernel failure"
    assert site.fast == 0 and dict(site.fallback) == {_policy.REASON_DISABLED: 3}


def test_kernel_errors_are_raised_under_compile(monkeypatch):
    monkeypatch.setattr(GATED_RESIDUAL, "guard", lambda *a, **k: None)
    monkeypatch.setattr(GATED_RESIDUAL, "custom_op", _failing_kernel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    residual, gate, update = make_inputs((1, 8, 64), torch.bfloat16, "adaln_chunk", "cpu", 2)
    with pytest.raises(RuntimeError, match="injected kernel failure"):
        gated_residual(residual, gate, update, Site("gated_residual"))
    assert GATED_RESIDUAL.disabled is None


def test_env_switch_sends_every_call_to_eager(monkeypatch):
    monkeypatch.setenv(_policy.ENV_DISABLE, "1")
    GATED_RESIDUAL.reset()
    monkeypatch.setattr(GATED_RESIDUAL, "kernel", _failing_kernel)
    site = Site("gated_residual")
    residual, gate, update = make_inputs((1, 8, 64), torch.bfloat16, "adaln_chunk", "cpu", 2)
    assert torch.equal(gated_residual(residual, gate, update, site), gated_residual_ref(residual, gate, update))
    assert dict(site.fallback) == {_policy.REASON_ENV: 1} and GATED_RESIDUAL.disabled is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_op_opcheck_cpu(layout):
    args = make_inputs((2, 9, 64), torch.bfloat16, layout, "cpu", 0)
    torch.library.opcheck(torch.ops.diffusers_fastpath.gated_residual.default, args)


def test_fake_gives_eager_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.diffusers_fastpath.gated_residual.default
    with FakeTensorMode():
        residual, gate, update = make_inputs((2, 9, 64), torch.bfloat16, "adaln_chunk", "cpu", 0)
        out = op(residual, gate, update)
    assert out.shape == (2, 9, 64) and out.dtype is torch.bfloat16 and out.is_contiguous()


def test_compiled_call_uses_the_custom_op_and_stays_exact(monkeypatch):
    """Under torch.compile (fullgraph) a guarded call becomes the custom op, whose real implementation is exact
    on any device (here the CPU, where it runs the eager expression)."""
    calls = []
    real_guard = GATED_RESIDUAL.guard

    def guard(*args, check_pointers=True):
        calls.append(check_pointers)
        return None if not check_pointers else real_guard(*args, check_pointers=check_pointers)

    monkeypatch.setattr(GATED_RESIDUAL, "guard", guard)
    residual, gate, update = make_inputs((1, 8, 64), torch.bfloat16, "adaln_chunk", "cpu", 4)
    fn = torch.compile(lambda a, b, c: gated_residual(a, b, c), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(residual, gate, update), gated_residual_ref(residual, gate, update))
    assert False in calls  # traced with pointer checks off, i.e. through the custom op


# --- gated_residual_fp32: Wan's chain (an fp32 gate, fp32 math, one rounding) -------------------------------------

# Wan 2.1 14B at 832x480x81 (21 latent frames of 30x52 patches: 32,760 tokens, D = 5120), a CFG batch, a small case
WAN_SHAPES = [(1, 32760, 5120), (2, 1560, 5120), (1, 17, 64)]


def make_fp32_gate_inputs(shape, dtype, layout, device, seed):
    """residual, update in `dtype` and an fp32 gate as Wan makes it: a chunk of ``scale_shift_table + temb.float()``
    (``[B, 6, D]`` chunked on dim 1: ``[B, 1, D]`` rows of batch stride 6D), or Wan 2.2 TI2V's per-token
    ``[B, L, 6, D]`` table's squeezed chunk (a full gate of row stride 6D)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, d = shape
    residual = (torch.randn(shape, generator=gen, device=device) * 4).to(dtype)
    update = (torch.randn(shape, generator=gen, device=device) * 4).to(dtype)
    if layout == "table_chunk":
        gate = torch.randn(b, 6, d, generator=gen, device=device).chunk(6, dim=1)[2]
    else:  # "per_token"
        gate = torch.randn(b, l, 6, d, generator=gen, device=device).chunk(6, dim=2)[2].squeeze(2)
    return residual, gate, update


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["table_chunk", "per_token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WAN_SHAPES, ids=str)
def test_gated_residual_fp32_matches_eager_bitwise(shape, dtype, layout):
    from diffusers_fastpath.ops import gated_residual_fp32, gated_residual_fp32_ref
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    if layout == "per_token" and shape[1] > 2000:
        shape = (shape[0], 2000, shape[2])  # the [B, L, 6, D] fp32 table of 32,760 tokens alone is 4 GiB
    for seed in range(2):
        residual, gate, update = make_fp32_gate_inputs(shape, dtype, layout, "cuda", seed)
        ref = gated_residual_fp32_ref(residual, gate, update)
        assert ref.dtype == dtype
        out = torch.full_like(residual, float("nan"))
        torch.ops.diffusers_fastpath._gated_residual_cuda_out(out, residual, gate, update)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        site = Site("gated_residual_fp32")
        assert torch.equal(gated_residual_fp32(residual, gate, update, site), ref)
        assert site.fast == 1 and not site.fallback, site


def test_rounding_the_product_is_not_wans_chain():
    """The fp32 chain differs from the half one: rounding the product to bf16 (FLUX's chain) changes many outputs,
    so only a kernel that keeps the product in fp32 passes the GPU test above."""
    from diffusers_fastpath.ops import gated_residual_fp32_ref

    residual, gate, update = make_fp32_gate_inputs((1, 256, 256), torch.bfloat16, "table_chunk", "cpu", 0)
    rounded = gated_residual_ref(residual, gate.to(residual.dtype), update)
    mismatch = (rounded != gated_residual_fp32_ref(residual, gate, update)).float().mean().item()
    assert mismatch > 0.05


@pytest.mark.parametrize("layout", ["table_chunk", "per_token"])
def test_fp32_gate_layouts_pass_the_guard_and_half_gates_do_not(layout):
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL_FP32

    residual, gate, update = make_fp32_gate_inputs((2, 24, 64), torch.bfloat16, layout, "cpu", 1)
    assert GATED_RESIDUAL_FP32.guard(residual, gate, update, check_pointers=False) == "device cpu"
    assert GATED_RESIDUAL_FP32.guard(residual, gate.bfloat16(), update) == "mixed dtypes"
    assert GATED_RESIDUAL.guard(residual, gate, update) == "mixed dtypes"  # FLUX's chain wants a gate of its dtype
    assert GATED_RESIDUAL_FP32.guard(residual.float(), gate, update.float()) == "dtype float32"


@pytest.mark.parametrize("layout", ["table_chunk", "per_token"])
def test_fp32_custom_op_opcheck_cpu(layout):
    residual, gate, update = make_fp32_gate_inputs((2, 24, 64), torch.bfloat16, layout, "cpu", 2)
    torch.library.opcheck(torch.ops.diffusers_fastpath.gated_residual_fp32.default, (residual, gate, update))
    out = torch.ops.diffusers_fastpath.gated_residual_fp32(residual, gate, update)
    from diffusers_fastpath.ops import gated_residual_fp32_ref

    assert out.dtype == torch.bfloat16 and torch.equal(out, gated_residual_fp32_ref(residual, gate, update))
