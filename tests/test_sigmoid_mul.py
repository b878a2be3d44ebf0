"""sigmoid_mul (a sigmoid output gate, ``x * torch.sigmoid(gate)``: Krea 2's attention processor): the rewriter's form
in any processor, the tiny Krea 2 patched == unpatched with its gates fused (kernels emulated on a CPU, real on a GPU),
the guard's refusals (each eager's result, counted), the layouts it takes, the custom op; on the GPU the kernel
against eager at Krea 2's shapes and odd ones, with poisoned outputs, its sigmoid proven on every value."""

from __future__ import annotations

import ast
import sys
import textwrap

import pytest
import torch
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models._chain_calls import _ChainsNamespace
from diffusers_fastpath.models._rewriter_attention import _sigmoid_gated
from diffusers_fastpath.ops import Site, sigmoid_mul, sigmoid_mul_ref
from diffusers_fastpath.ops._policy import REASON_LAYOUT
from diffusers_fastpath.ops.sigmoid_mul import SIGMOID_MUL
from diffusers_fastpath.testing import zoo

DTYPES = [torch.bfloat16, torch.float16]
MODULE = sys.modules["diffusers_fastpath.ops.sigmoid_mul"]  # (the package binds the name to the op function)


def make_inputs(shape, dtype, device, seed, layout="contiguous"):
    """``(x, gate)``: two contiguous tensors (Krea 2's attention output and ``to_gate``'s), or the two
    ``chunk(2, dim=-1)`` halves of one ``[..., 2D]`` tensor (row stride 2D: strided rows, laid out alike)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if layout == "chunk":
        both = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen, device=device) * 3).to(dtype)
        return both.chunk(2, dim=-1)
    return tuple((torch.randn(shape, generator=gen, device=device) * 3).to(dtype) for _ in range(2))


# --- the rewriter's form ------------------------------------------------------------------------------------------


def _value(source: str) -> ast.expr:
    return ast.parse(textwrap.dedent(source)).body[0].value


def test_sigmoid_gated_form():
    left, func, arg = _sigmoid_gated(_value("h = h.flatten(2, 3) * torch.sigmoid(attn.to_gate(x))"))
    assert (ast.unparse(left), ast.unparse(func), ast.unparse(arg)) == (
        "h.flatten(2, 3)", "torch.sigmoid", "attn.to_gate(x)")
    for bad in ("h = torch.sigmoid(g) * h", "h = h * torch.sigmoid(g, out=y)", "h = h * torch.sigmoid(*g)",
                "h = h * th.sigmoid(g)", "h = h + torch.sigmoid(g)", "h = h * torch.tanh(g)", "h = h * g.sigmoid()",
                "h = h * torch.sigmoid(g, g)", "h = h * torch.special.sigmoid(g)"):
        assert _sigmoid_gated(_value(bad)) is None, bad


class _Proj(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.to_gate = nn.Linear(dim, dim, bias=False)


class GatedProcessor:
    """Not Krea 2's: the form as an assignment and as a return, operands of any expression."""

    def __call__(self, attn, hidden_states, gate_input):
        out = attn.proj(hidden_states) * torch.sigmoid(attn.to_gate(gate_input))
        return out * torch.sigmoid(gate_input + 1)


def test_any_processor_with_the_form_is_rewritten(emulated_kernels):
    from diffusers_fastpath.models.generic import generic_subclass

    sub, found = generic_subclass(GatedProcessor, "__call__", {})
    assert sub is not None and found.sigmoid_mul == 2
    torch.manual_seed(0)
    attn = _Proj(64).to(torch.bfloat16).requires_grad_(False)
    h, g = (torch.randn(2, 9, 64).to(torch.bfloat16) for _ in range(2))
    site = attn._fastpath_site_sigmoid_mul = Site("sigmoid_mul")
    assert torch.equal(sub()(attn, h, g), GatedProcessor()(attn, h, g))
    assert site.fast == 2 and not site.fallback, site


def test_a_sigmoid_that_is_not_torchs_runs_as_written():
    """``mul_sigmoid`` takes only torch's sigmoid on tensors; anything else is the product as written, uncounted."""
    x, gate = make_inputs((1, 8, 64), torch.bfloat16, "cpu", 0)
    site = Site("sigmoid_mul")
    assert torch.equal(_ChainsNamespace.mul_sigmoid(x, torch.tanh, gate, site), x * torch.tanh(gate))
    assert _ChainsNamespace.mul_sigmoid(2.0, torch.sigmoid, gate, site).equal(2.0 * torch.sigmoid(gate))
    assert site.fast == 0 and not site.fallback
    assert torch.equal(_ChainsNamespace.mul_sigmoid(x, torch.sigmoid, gate, site), sigmoid_mul_ref(x, gate))
    assert site.fallback == {"device cpu": 1}


# --- the tiny Krea 2 ------------------------------------------------------------------------------------------------


def _krea2_gate_sites(device: str):
    """The tiny Krea 2 on `device` through the zoo's check (patched == unpatched, the first forward verified, a second
    trusted, unpatch restoring every class): its sigmoid_mul sites, one per attention (the transformer's blocks and the
    text fusion's)."""
    from test_generic_zoo import _check

    sites = [s for s in _check("krea2", device) if s.op == "sigmoid_mul"]
    assert len(sites) == 6, sites
    return sites


def test_tiny_krea2_patched_equals_unpatched_on_cpu():
    """On a CPU the op refuses ("device cpu", counted at each attention's site) and the product runs as written."""
    sites = _krea2_gate_sites("cpu")
    assert all(s.fallback == {"device cpu": 2} and not s.fast for s in sites), sites


def test_tiny_krea2_runs_its_gates_fused(emulated_kernels):
    """The kernel emulated (its arithmetic: the sigmoid rounded, one product): every attention's gate fast in both
    forwards, verified against eager on its first call."""
    sites = _krea2_gate_sites("cpu")
    assert all(s.fast == 2 and not s.fallback for s in sites), sites
    assert SIGMOID_MUL.disabled is None and SIGMOID_MUL.verified == {("bfloat16",)}


def test_unpatch_gives_krea2_its_processors_back():
    model = zoo.build("krea2", dtype=torch.bfloat16, device="cpu")
    attentions = [m for m in model.modules() if hasattr(m, "processor")]
    processors = [type(m.processor) for m in attentions]
    fp.patch(model, verify=False)
    try:
        assert all(type(m.processor) is not cls for m, cls in zip(attentions, processors))
        assert all(isinstance(getattr(m, "_fastpath_site_sigmoid_mul", None), Site) for m in attentions)
    finally:
        fp.unpatch(model)
    assert [type(m.processor) for m in attentions] == processors
    assert not [s for m in model.modules() for _, s in sites_of(m)]


# --- the guard ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, reason", [
    ("cpu", "device cpu"), ("fp32", "dtype float32"), ("mixed", "mixed dtypes"), ("shape", "shape"),
    ("odd", "D not a multiple of 8"), ("strided", "rows strided"), ("x-transposed", "operands laid out differently"),
    ("gate-transposed", "operands laid out differently"), ("seq-first", REASON_LAYOUT), ("1d", "shape"),
    ("grad", "requires grad")])
def test_guard_refuses_with_reason_and_the_result_is_eagers(case, reason, monkeypatch):
    """Every refusal counted with its reason and eager's result, in eager's layout (the device taken as a GPU's but
    for the "cpu" case, so that each later check is reached)."""
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    x, gate = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 1)
    seq_first = torch.randn(9, 2, 256, dtype=torch.bfloat16).transpose(0, 1).chunk(2, dim=-1)
    args = {
        "cpu": (x, gate), "fp32": (x.float(), gate.float()), "mixed": (x, gate.half()), "shape": (x, gate[:, :1]),
        "odd": (x[..., :60], gate[..., :60]), "strided": (x[..., ::2], gate[..., ::2]),
        "x-transposed": (x.transpose(0, 1).contiguous().transpose(0, 1), gate),
        "gate-transposed": (x, gate.transpose(0, 1).contiguous().transpose(0, 1)), "seq-first": seq_first,
        "1d": (x[0, 0], gate[0, 0]), "grad": (x.clone().requires_grad_(), gate),
    }[case]
    assert SIGMOID_MUL.guard(*args, check_pointers=False) == reason
    site = Site("sigmoid_mul")
    with torch.no_grad() if case != "grad" else torch.enable_grad():
        out, ref = sigmoid_mul(*args, site), sigmoid_mul_ref(*args)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_the_layouts_it_takes_give_eagers_values_and_strides(monkeypatch):
    """Through the op's own wrapper (the raw kernel replaced by the eager product made contiguous, the kernel's
    rows): contiguous ``[B, S, D]`` (Krea 2's), the halves of one projection (strided rows), the flattened output of
    an attention's ``permute`` back (a view of token-major memory), packed ``[N, D]`` rows and a channels-last feature
    map's channel halves: each fast, with eager's values and strides."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(MODULE, "_cuda_op", lambda g, u: (u * torch.sigmoid(g)).contiguous())
    monkeypatch.setattr(SIGMOID_MUL, "prove", None)  # (it runs the CUDA kernel on every value)
    sdpa = torch.randn(2, 9, 4, 32, dtype=torch.bfloat16).transpose(1, 2)  # [B, H, S, D] of token-major memory
    attention = sdpa.permute(0, 2, 1, 3).flatten(2, 3)  # diffusers' native backend's permute back, then the flatten
    channels_last = torch.randn(2, 4, 6, 32, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    cases = [make_inputs((2, 9, 128), torch.bfloat16, "cpu", 2), make_inputs((2, 9, 64), torch.bfloat16, "cpu", 3,
                                                                             "chunk"),
             (attention, torch.randn(2, 9, 128, dtype=torch.bfloat16)),
             torch.randn(9, 128, dtype=torch.bfloat16).chunk(2, dim=-1), channels_last.chunk(2, dim=1)]
    for x, gate in cases:
        site = Site("sigmoid_mul")
        out, ref = sigmoid_mul(x, gate, site), sigmoid_mul_ref(x, gate)
        assert torch.equal(out, ref) and out.stride() == ref.stride()
        assert (site.fast, dict(site.fallback)) == (1, {}), (x.shape, x.stride())


def test_rounding_the_sigmoid_matters():
    """Keeping the sigmoid in fp32 into the product (skipping its rounding) changes many outputs: only a kernel with
    eager's two rounding points passes the GPU tests below."""
    x, gate = make_inputs((1, 64, 512), torch.bfloat16, "cpu", 0)
    unrounded = (x.float() * torch.sigmoid(gate.float())).to(torch.bfloat16)
    assert (unrounded != sigmoid_mul_ref(x, gate)).float().mean().item() > 0.05


@pytest.mark.parametrize("layout", ["contiguous", "chunk"])
def test_custom_op_opcheck_cpu(layout):
    x, gate = make_inputs((2, 9, 128), torch.bfloat16, "cpu", 4, layout)
    torch.library.opcheck(torch.ops.diffusers_fastpath.sigmoid_mul.default, (x, gate))
    assert torch.equal(torch.ops.diffusers_fastpath.sigmoid_mul(x, gate), sigmoid_mul_ref(x, gate))


# --- GPU ------------------------------------------------------------------------------------------------------------

# [B, S, D]: Krea 2 at 1024x1024 (4096 image + 512 text tokens, 48 x 128 = 6144 wide), a CFG batch of two, its text
# fusion's width, odd ones (one vector per row, one row, rows of 17 vectors)
SHAPES = [(1, 4096 + 512, 6144), (2, 4096 + 512, 6144), (1, 1536, 6144), (1, 17, 64), (3, 1, 8), (2, 33, 136)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sigmoid_mul_matches_eager_bitwise_and_is_proven(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):
        x, gate = make_inputs(shape, dtype, "cuda", seed, layout)
        ref = sigmoid_mul_ref(x, gate)
        out = torch.full_like(ref, float("nan"))  # poisoned: every element must be written
        torch.ops.diffusers_fastpath._sigmoid_mul_cuda_out(out, gate, x)
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        site = Site("sigmoid_mul")
        got = sigmoid_mul(x, gate, site)
        assert torch.equal(got, ref) and got.stride() == ref.stride()
        assert site.fast == 1 and not site.fallback, site  # the proof on all 65536 values passed
    assert SIGMOID_MUL.disabled is None and SIGMOID_MUL.verified == {(str(dtype).removeprefix("torch."),)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "nomask"])
def test_krea2_attention_output_is_taken_as_it_comes(dtype, masked):
    """The gate's real operand: diffusers' native attention at Krea 2's shapes (``[1, 4608, 48, 128]``, its text
    padding mask or none), ``flatten(2, 3)``, times the sigmoid of a contiguous gate: fast (the attention's output is
    laid out as the gate), equal to eager."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 4608, 48, 128, generator=gen, device="cuda").to(dtype) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(1, 1, 1, 4608, dtype=torch.bool, device="cuda")
        mask[..., 4096 + 160:] = False
    with torch.no_grad():
        x = dispatch_attention_fn(q, k, v, attn_mask=mask).flatten(2, 3)
    gate = (torch.randn(1, 4608, 6144, generator=gen, device="cuda") * 3).to(dtype)
    site = Site("sigmoid_mul")
    out = torch.full_like(x, float("nan"))
    del out  # its block is what the caching allocator hands the kernel's output next: NaN unless written
    got = sigmoid_mul(x, gate, site)
    assert torch.equal(got, sigmoid_mul_ref(x, gate)) and site.fast == 1 and not site.fallback, (x.stride(), site)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, width", [(4608, 6144), (17, 64)])
def test_sigmoid_mul_packed_rows_match_eager_bitwise(rows, width, dtype):
    """Packed ``[N, D]`` rows: the kernel's ``[1, N, D]``, every element written, viewed back as ``[N, D]``."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op is registered by the extension (under xdist this test may run first)
    x, gate = make_inputs((rows, width), dtype, "cuda", 5)
    ref = sigmoid_mul_ref(x, gate)
    out = torch.full((1, rows, width), float("nan"), dtype=dtype, device="cuda")
    torch.ops.diffusers_fastpath._sigmoid_mul_cuda_out(out, gate[None], x[None])
    assert torch.equal(out[0], ref)
    site = Site("sigmoid_mul")
    got = sigmoid_mul(x, gate, site)
    assert torch.equal(got, ref) and got.shape == ref.shape and site.fast == 1, site


@pytest.mark.gpu
def test_tiny_krea2_on_the_gpu_has_its_gates_fast():
    sites = _krea2_gate_sites("cuda")
    assert all(s.fast == 2 and not s.fallback for s in sites), sites
