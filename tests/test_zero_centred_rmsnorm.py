"""Krea 2's zero-centred float32 RMSNorm (``Krea2RMSNorm``) as the fused `zero_centred_rmsnorm`: on the GPU the kernel
against eager at Krea 2's shapes (poisoned outputs, fresh inputs, bf16 and fp16); on a CPU the guard, the swap of
the norm classes (state dict, hooks, a forward replaced later, pickles in a fresh process, unpatch) and the wiring
through the emulated kernels."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

import diffusers_fastpath as fp
from diffusers_fastpath._state import sites_of
from diffusers_fastpath.models import _qk_norms
from diffusers_fastpath.models._chain_qk_fp32 import is_zero_centred
from diffusers_fastpath.ops import Site, zero_centred_rmsnorm, zero_centred_rmsnorm_ref
from diffusers_fastpath.ops.zero_centred_rmsnorm import ZERO_CENTRED_RMSNORM, _guard
from diffusers_fastpath.testing import zoo
from test_nvrtc import both_ways  # noqa: F401 (the fixture: the nvcc extension and the NVRTC cubins)

DTYPES = [torch.bfloat16, torch.float16]


def _norm(dim: int, device: str, seed: int) -> Krea2RMSNorm:
    """A Krea 2 norm of `dim`, swapped as `patch` swaps it, with random weights (zero-initialised in diffusers: the
    scale 1 + w would be 1 everywhere)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    norm = Krea2RMSNorm(dim, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(dim, generator=gen, device=device))
    norm.__class__ = _qk_norms.zero_centred_class(Krea2RMSNorm)
    return norm.requires_grad_(False)


def _x(shape, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.rand(shape[-1], generator=gen, device=device) * 8 + 0.1  # channels of very different sizes
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


# (rows..., C): Krea 2 at 1024x1024 (4096 image + 512 text tokens, 6144 wide), its text fusion (512 tokens of 12 tapped
# layers, 2560 wide; the refiner's 512 rows), the QK norms' head dim, the kernel's widest row, a C that is not a
# multiple of 128, a batch of two; the rows of at most 128 (a warp a row, 32 rows a block): the text refiner's heads
# (512 tokens x 12 layers x 20 heads of 128), a row count that ends a block early, widths whose last lanes hold no data
CASES = [(1, 4608, 6144), (512 * 12, 2560), (1, 512, 2560), (4096, 48, 128), (3, 8192),
         (2, 77, 1028), (2, 1037, 6144)]
NARROW = [(512, 12, 20, 128), (7, 128), (3, 37, 124), (1029, 64), (45, 96), (33, 4), (2, 5, 132)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CASES + NARROW, ids=str)
def test_zero_centred_rmsnorm_matches_eager_bitwise(shape, dtype):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()  # the raw op: the nvcc extension's, else NVRTC's (tests/test_nvrtc.py runs both)
    for seed in range(2):  # fresh inputs and weights each round
        norm, x = _norm(shape[-1], "cuda", seed), _x(shape, dtype, "cuda", seed + 10)
        ref = zero_centred_rmsnorm_ref(norm, x)
        assert ref.dtype is dtype and torch.isfinite(ref).all() and ref.float().std() > 0.1
        torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # freed: the output's block next
        raw = torch.ops.diffusers_fastpath._zero_centred_rmsnorm_cuda(x.view(-1, shape[-1]), norm.weight + 1.0,
                                                                      norm.eps, 0)
        torch.cuda.synchronize()
        assert torch.equal(raw.view(shape), ref)
        site = Site("zero_centred_rmsnorm")
        out = zero_centred_rmsnorm(norm, x, site)
        assert torch.equal(out, ref) and out.is_contiguous()
        assert site.fast == 1 and not site.fallback, site
        assert torch.equal(norm(x), ref)  # the swapped module's own call
    assert ZERO_CENTRED_RMSNORM.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NARROW + CASES[-1:], ids=str)
def test_nvrtc_and_nvcc_kernels_equal_eager(shape, dtype, both_ways):
    """The NVRTC launcher (and the nvcc extension's op where a toolkit built it) on the narrow rows and a wide row."""
    import importlib

    norm_mod = importlib.import_module("diffusers_fastpath.ops.zero_centred_rmsnorm")  # (the package's: a function)
    for seed in range(2):
        norm, x = _norm(shape[-1], "cuda", seed), _x(shape, dtype, "cuda", seed + 10)
        ref = zero_centred_rmsnorm_ref(norm, x)
        assert torch.isfinite(ref).all() and ref.float().std() > 0.1
        nvcc = [torch.ops.diffusers_fastpath._zero_centred_rmsnorm_cuda] if both_ways else []
        ways = [norm_mod._nvrtc_kernel] + nvcc
        for way in ways:
            torch.full((ref.numel() + 4096,), float("nan"), device="cuda", dtype=dtype)  # the output's block next
            out = way(x.view(-1, shape[-1]), norm.weight + 1.0, norm.eps, 0)
            torch.cuda.synchronize()
            assert torch.equal(out.view(shape), ref), way


@pytest.mark.gpu
def test_krea2_zoo_model_runs_the_zero_centred_norms_fused_on_cuda():
    from test_generic_zoo import _check

    sites = [s for s in _check("krea2", "cuda") if s.op == "zero_centred_rmsnorm"]
    assert sum(s.fast for s in sites) > 0 and not any(s.fallback for s in sites), sites


@pytest.mark.parametrize("case, reason", [
    ("float32", "dtype float32"),
    ("c_not_multiple_of_4", "C outside the reproduced reduction"),
    ("c_too_wide", "C outside the reproduced reduction"),
    ("transposed", "x not contiguous"),
    ("weight_bf16", "weight not a float32 [C] vector"),
    ("eps_int", "eps not a python float"),
    ("unswapped", "Krea2RMSNorm is not a checked zero-centred RMSNorm"),
    ("cpu", "device cpu"),
])
def test_guard_refuses_with_reason_and_the_fallback_is_eager(case, reason):
    dim = {"c_not_multiple_of_4": 66, "c_too_wide": 8196}.get(case, 64)
    norm, x = _norm(dim, "cpu", 0), _x((2, 5, dim), torch.bfloat16, "cpu", 1)
    if case == "float32":
        x = x.float()
    elif case == "transposed":
        x = x.transpose(0, 1)
    elif case == "weight_bf16":
        norm.weight.data = norm.weight.data.bfloat16()
    elif case == "eps_int":
        norm.eps = 0
    elif case == "unswapped":
        norm.__class__ = Krea2RMSNorm
    assert _guard(norm, x, check_pointers=False) == reason
    site = Site("zero_centred_rmsnorm")
    expected = Krea2RMSNorm.forward(norm, x)
    assert torch.equal(zero_centred_rmsnorm(norm, x, site), expected)
    assert site.fast == 0 and reason in site.fallback


def test_patch_swaps_every_zero_centred_norm_and_unpatch_restores(emulated_kernels):
    model = zoo.build("krea2", dtype=torch.bfloat16, device="cpu")
    kwargs = zoo.inputs("krea2", model)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(**kwargs)[0].clone()
    norms = [m for m in model.modules() if isinstance(m, Krea2RMSNorm)]
    fp.patch(model)
    swapped = [m for m in norms if type(m) is not Krea2RMSNorm]
    assert swapped == norms and all(is_zero_centred(m) for m in norms)
    assert type(norms[0]).__name__ == "FastpathKrea2RMSNorm" and isinstance(norms[0], Krea2RMSNorm)
    assert model.state_dict().keys() == state_dict.keys()
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], ref) and torch.equal(model(**kwargs)[0], ref)
    sites = {name: s for name, m in model.named_modules() if m in norms for n, s in sites_of(m) if n is None}
    assert len(sites) == len(norms) and all(s.op == "zero_centred_rmsnorm" for s in sites.values()), sites
    assert not any(s.fallback for s in sites.values()), sites
    # every norm ran fused: alone, or inside its chain's kernel (the QK norms that a rotary follows: the fused norm +
    # rotary; the pre-norms a modulate reads: `zero_centred_modulate`, with its own site on the norm, "norm_modulate")
    in_chain = {name for name, m in model.named_modules() if m in norms
                for n, s in sites_of(m) if n == "norm_modulate" and s.op == "zero_centred_modulate" and s.fast > 0}
    assert in_chain and all(s.fast > 0 for name, s in sites.items()
                            if not name.endswith(("norm_q", "norm_k")) and name not in in_chain), sites
    fp.unpatch(model)
    assert all(type(m) is Krea2RMSNorm for m in norms)
    assert all(torch.equal(v, state_dict[k]) for k, v in model.state_dict().items())


def test_hooks_on_a_swapped_norm_run_around_the_fused_norm(emulated_kernels):
    norm, x = _norm(64, "cpu", 0), _x((3, 64), torch.bfloat16, "cpu", 1)
    norm.__dict__["_fastpath_site"] = site = Site("zero_centred_rmsnorm")
    calls = []
    norm.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    norm.register_forward_hook(lambda module, args, out: calls.append(out) or out + 1)
    out = norm(x)
    assert site.fast == 1 and not site.fallback  # the fused norm is the module's own forward: its hooks run
    assert torch.equal(calls[0], Krea2RMSNorm.forward(norm, x * 2)) and torch.equal(out, calls[0] + 1)


def test_a_forward_replaced_after_patching_runs_as_replaced(emulated_kernels, monkeypatch):
    norm, x = _norm(64, "cpu", 0), _x((3, 64), torch.bfloat16, "cpu", 1)
    site = Site("zero_centred_rmsnorm")
    assert torch.equal(zero_centred_rmsnorm(norm, x, site), Krea2RMSNorm.forward(norm, x)) and site.fast == 1

    def replaced(self, hidden_states):
        return hidden_states * 2

    monkeypatch.setattr(Krea2RMSNorm, "forward", replaced)
    assert torch.equal(norm(x), x * 2)  # the guard refuses (a forward not written in its class): the replacement runs
    assert not is_zero_centred(norm)


def test_a_patched_model_pickles_into_a_fresh_process(emulated_kernels, tmp_path):
    norm = _norm(64, "cpu", 0)
    path = tmp_path / "norm.pt"
    path.write_bytes(pickle.dumps(norm))
    cls_name = type(norm).__qualname__
    code = (f"import pickle, torch; norm = pickle.loads(open({str(path)!r}, 'rb').read()); "
            f"assert type(norm).__qualname__ == {cls_name!r}; x = torch.randn(3, 64).bfloat16(); "
            "from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm; "
            "assert torch.equal(norm(x), Krea2RMSNorm.forward(norm, x)); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
