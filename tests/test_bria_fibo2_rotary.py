"""Bria FIBO 2's processor-local complex rotary: Z-Image's form (the same complex multiply, without the autocast block)
under another source digest, recognised by the generic path as that form, so that its QK norm and rotary run as
`rmsnorm_rope_complex` (self-verified on the GPU)."""

from __future__ import annotations

import ast
import hashlib

import pytest
import torch
from diffusers.models.transformers import transformer_bria_fibo2, transformer_z_image


def _local(cls):
    from diffusers_fastpath.models.generic import _local_defs

    return _local_defs(cls.__call__)["apply_rotary_emb"]


def test_the_recorded_digest_is_the_installed_function_and_known_as_the_local_form():
    from diffusers_fastpath.models.generic import FIBO2, _form_digest, known_rotaries, processor_hints

    local = _local(transformer_bria_fibo2.BriaFibo2AttnProcessor)
    assert hashlib.sha256(ast.unparse(local).encode()).hexdigest()[:16] == FIBO2[1]
    assert known_rotaries()[_form_digest(local)] == "local"
    assert processor_hints(transformer_bria_fibo2.BriaFibo2AttnProcessor.__call__)["local_rotary"][0] == FIBO2[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_it_computes_what_z_images_function_computes(dtype):
    """Both local functions, compiled from their sources, on the same operands (an autocast region included)."""
    def compiled(cls):
        namespace = {"torch": torch}
        exec(compile(ast.Module([_local(cls)], []), "<local>", "exec"), namespace)  # noqa: S102 (diffusers' source)
        return namespace["apply_rotary_emb"]

    fibo2, zimage = compiled(transformer_bria_fibo2.BriaFibo2AttnProcessor), compiled(
        transformer_z_image.ZSingleStreamAttnProcessor)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, 16, generator=gen).to(dtype)
    freqs = torch.polar(torch.ones(2, 9, 8), torch.rand(2, 9, 8, generator=gen) * 100)
    assert torch.equal(fibo2(x, freqs), zimage(x, freqs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fibo2(x, freqs), zimage(x, freqs))


def _fibo2_sites(device):
    from test_generic_zoo import _check

    return [s for s in _check("bria-fibo2", device) if s.op == "rmsnorm_rope_complex"]


def test_zoo_bria_fibo2_is_exact_with_its_qk_norm_and_rotary_fused(emulated_kernels):
    sites = _fibo2_sites("cpu")
    # the self-attentions' q and k in both forwards; the cross-attentions get no rotary table and count nothing
    assert sorted(s.fast for s in sites) == [0, 0, 0, 4, 4, 4] and not any(s.fallback for s in sites), sites


@pytest.mark.gpu
def test_zoo_bria_fibo2_runs_the_fused_op_on_cuda():
    sites = _fibo2_sites("cuda")
    assert sum(s.fast for s in sites) == 12 and not any(s.fallback for s in sites), sites
