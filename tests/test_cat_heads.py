"""cat_heads: ``torch.cat([a, b], dim=2)`` of two ``[B, H, S, D]`` operands as one vectorised copy (SD3's joint
attention): bit-identical and contiguous at SD3.5's shapes on GPU, both build ways; its guards, its first-call
check and fallback policy everywhere."""

from __future__ import annotations

import pytest
import torch

from diffusers_fastpath.ops import Site, cat_heads, cat_heads_ref
from diffusers_fastpath.ops.cat_heads import CAT_HEADS, _guard

DTYPES = [torch.bfloat16, torch.float16]
# (batch, heads, image tokens, text tokens, head_dim): SD3.5-large at 1024x1024 (CLIP 77 + T5 256 = 333 text tokens),
# the CFG batch, SD3.5-medium's 24 heads at 512x512, a small odd case
SHAPES = [(1, 38, 4096, 333, 64), (2, 38, 4096, 333, 64), (1, 24, 1024, 333, 64), (2, 3, 17, 5, 64)]


def sd3_operands(shape, dtype, device, seed, layout="views"):
    """SD3's operands: ``[B, H, S, D]`` views of ``[B, S, H, D]`` projections ("views"), contiguous ``[B, H, S, D]``
    tensors ("contiguous"), or the image operand a view and the text one contiguous ("mixed")."""
    b, h, sa, sb, d = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def one(s, view):
        if view:
            return torch.randn(b, s, h, d, generator=gen, device=device).to(dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, generator=gen, device=device).to(dtype)

    return one(sa, layout in ("views", "mixed")), one(sb, layout == "views")


# --- GPU: the contract ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["views", "contiguous", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cat_heads_matches_torch_cat_bitwise_and_contiguous(shape, dtype, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op: the nvcc extension's, else NVRTC's (tests/test_nvrtc.py runs both in one process)
    for seed in range(2):  # fresh inputs each round
        a, b = sd3_operands(shape, dtype, "cuda", seed, layout)
        ref = cat_heads_ref(a, b)
        # poison what the allocator will hand the kernel's output: every element must be written
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)
        out = torch.ops.diffusers_fastpath._cat_heads_cuda(a, b)
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and out.is_contiguous() and out.stride() == ref.stride()
        site = Site("cat_heads")
        got = cat_heads(a, b, site)
        assert site.fast == 1 and not site.fallback, site
        assert torch.equal(got, ref) and got.stride() == ref.stride()
    assert CAT_HEADS.disabled is None


@pytest.mark.gpu
def test_cat_heads_cuda_guards_fall_back_exactly():
    a, b = sd3_operands((1, 4, 64, 16, 64), torch.bfloat16, "cuda", 0)
    site = Site("cat_heads")
    misaligned = torch.empty(b.numel() + 1, device="cuda", dtype=b.dtype)[1:].view(b.shape).copy_(b)
    cases = [(a, misaligned), (a.float(), b.float()), (a, b.half()), (a[:, :1], b[:, :1]), (a[..., ::2], b[..., ::2])]
    for args in cases:
        assert torch.equal(cat_heads(*args, site=site), cat_heads_ref(*args))
    assert site.fast == 0
    assert dict(site.fallback) == {"not 16-byte aligned": 1, "dtype float32": 1, "mixed dtypes": 1, "one head": 1,
                                   "rows strided": 1}


@pytest.mark.gpu
def test_cat_heads_opcheck_and_compile_fullgraph_cuda():
    a, b = sd3_operands((2, 3, 17, 5, 64), torch.bfloat16, "cuda", 1)
    torch.library.opcheck(torch.ops.diffusers_fastpath.cat_heads.default, (a, b))
    site = Site("cat_heads")
    ref = cat_heads_ref(a, b)
    assert torch.equal(cat_heads(a, b, site), ref)  # eager: checks this signature
    compiled = torch.compile(lambda x, y: cat_heads(x, y, site), fullgraph=True)
    assert torch.equal(compiled(a, b), ref)


# --- CPU: guards, the first-call check, the fallback policy ------------------------------------------------------


@pytest.mark.parametrize(
    "case, reason",
    [
        ("fp32", "dtype float32"),
        ("mixed", "mixed dtypes"),
        ("rank", "shape"),
        ("heads", "shape"),
        ("dim", "shape"),
        ("odd_dim", "D not a multiple of 8"),
        ("empty", "empty"),
        ("strided_rows", "rows strided"),
        ("one_head", "one head"),
        ("requires_grad", "requires grad"),
        ("cpu", "device cpu"),
    ],
)
def test_guard_says_why_it_refuses(case, reason):
    a, b = sd3_operands((1, 4, 9, 5, 64), torch.bfloat16, "cpu", 0)
    args = {
        "fp32": (a.float(), b.float()),
        "mixed": (a, b.half()),
        "rank": (a[0], b[0]),
        "heads": (a, b[:, :2]),
        "dim": (a, b[..., :32]),
        "odd_dim": (a[..., :60], b[..., :60]),
        "empty": (a[:, :, :0], b),
        "strided_rows": (a[..., ::2], b[..., ::2]),
        "one_head": (a[:, :1], b[:, :1]),
        "requires_grad": (a.detach().requires_grad_(), b),
        "cpu": (a, b),
    }[case]
    assert _guard(*args) == reason


def test_a_guarded_out_call_is_torch_cat_and_counted(fastpath_log):
    a, b = sd3_operands((2, 4, 9, 5, 64), torch.bfloat16, "cpu", 1)
    site = Site("cat_heads")
    out = cat_heads(a, b, site)
    ref = torch.cat([a, b], dim=2)
    assert torch.equal(out, ref) and out.stride() == ref.stride() and ref.is_contiguous()
    assert site.fast == 0 and dict(site.fallback) == {"device cpu": 1}
    assert not fastpath_log.records


@pytest.fixture
def guard_open(monkeypatch):
    """The guard admitting CPU tensors (as if on CUDA) and a fresh policy state, so the first-call check runs."""
    monkeypatch.setattr(CAT_HEADS, "guard", lambda a, b, check_pointers=True: None)
    monkeypatch.setattr(CAT_HEADS, "verified", set())
    monkeypatch.setattr(CAT_HEADS, "disabled", None)


def test_a_kernel_that_reads_the_wrong_rows_is_caught_on_first_use(guard_open, monkeypatch, fastpath_log):
    """A copy cannot round differently, but it can address wrongly: the first call of a layout is compared with
    torch.cat; a mismatch disables the op with one warning and every call returns torch.cat's result."""
    a, b = sd3_operands((1, 4, 9, 5, 64), torch.bfloat16, "cpu", 2)
    monkeypatch.setattr(CAT_HEADS, "kernel", lambda x, y: torch.cat([x.contiguous(), y.flip(2).contiguous()], dim=2))
    site = Site("cat_heads")
    for _ in range(2):
        assert torch.equal(cat_heads(a, b, site), cat_heads_ref(a, b))
    assert CAT_HEADS.disabled is not None and site.fast == 0
    assert len([r for r in fastpath_log.records if r.levelname == "WARNING"]) == 1


def test_a_correct_kernel_is_checked_once_per_layout(guard_open, monkeypatch):
    calls = []

    def kernel(x, y):
        calls.append(1)
        return torch.cat([x, y], dim=2).contiguous()

    monkeypatch.setattr(CAT_HEADS, "kernel", kernel)
    a, b = sd3_operands((1, 4, 9, 5, 64), torch.bfloat16, "cpu", 3)
    c, d = sd3_operands((1, 4, 9, 5, 64), torch.bfloat16, "cpu", 4, layout="contiguous")
    site = Site("cat_heads")
    for args in ((a, b), (a, b), (c, d), (c, d)):
        assert torch.equal(cat_heads(*args, site=site), cat_heads_ref(*args))
    assert site.fast == 4 and len(CAT_HEADS.verified) == 2 and CAT_HEADS.disabled is None
