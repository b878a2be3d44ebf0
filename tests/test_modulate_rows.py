"""The modulate-rows form (`_chain_calls._ChainsNamespace.modulate_rows`): ``N * (1 + S) + T`` or ``(1.0 + S) * N +
T`` of an already-normalised tensor, with rows per sample, per frame or per token, as `modulate_scale_shift` where
its ``[R, L, D]`` / ``[R, D]`` indexing is the same, and as written elsewhere; plus the gated residual whose roles
only the shapes tell and the SwiGLU product written either way round. Bit for bit against the expressions as
written, on a CPU (the kernel emulated) and, marked ``gpu``, at the full-size shapes of MiniMax-H3, LTX-2 and Krea 2
with the real kernel."""

from __future__ import annotations

import pytest
import torch

from diffusers_fastpath.models._chain_calls import _ChainsNamespace as NS
from diffusers_fastpath.models._chain_calls import _modulate_rows
from diffusers_fastpath.ops import Site


def _written(first, second, shift, one, normed_left):
    return (first * (one + second) if normed_left else (one + first) * second) + shift


def _rand(*shape, dtype=torch.bfloat16, device="cpu", gen=None):
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


# (x shape, scale shape, shift shape, taken): what the op takes, and what runs as written
CASES = [
    ((2, 24, 64), (2, 1, 64), (2, 1, 64), True),    # per sample (Krea 2's unbind rows, LTX-Video's)
    ((2, 24, 64), (1, 1, 64), (2, 1, 64), True),    # one row for all, per sample
    ((1, 24, 64), (24, 64), (24, 64), True),        # per token at batch 1 (MiniMax-H3's index_select rows)
    ((2, 24, 64), (2, 24, 64), (2, 24, 64), True),  # per token (LTX-2's squeeze(2) rows)
    ((2, 3, 8, 64), (2, 3, 1, 64), (2, 3, 1, 64), True),  # per frame (SANA-WM's [B, F, 1, C])
    ((24, 64), (24, 64), (1, 64), False),            # per token and one row: two mappings
    ((24, 64), (24, 64), (24, 64), True),            # packed rows
    ((2, 24, 64), (24, 64), (24, 64), False),        # [L, D] rows at batch 2: not one row per token of a view
    ((1, 24, 64), (4, 24, 64), (4, 24, 64), False),  # rows that broadcast x: another shape
    ((2, 24, 64), (2, 1, 64), (2, 24, 64), False),   # mixed mappings
    ((2, 24, 64), (64,), (64,), False),              # 1-D rows
]


@pytest.mark.parametrize("x_shape, s_shape, t_shape, taken", CASES, ids=str)
@pytest.mark.parametrize("one, normed_left", [(1, True), (1.0, True), (1.0, False), (1, False)])
def test_modulate_rows_is_the_expression_as_written(x_shape, s_shape, t_shape, taken, one, normed_left,
                                                    emulated_kernels):
    gen = torch.Generator().manual_seed(len(x_shape) + len(s_shape))
    x, scale, shift = _rand(*x_shape, gen=gen), _rand(*s_shape, gen=gen) * 0.5, _rand(*t_shape, gen=gen)
    first, second = (x, scale) if normed_left else (scale, x)
    want = _written(first, second, shift, one, normed_left)
    site = Site("modulate_scale_shift")
    got = NS.modulate_rows(first, second, shift, site, one, normed_left)
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    assert (_modulate_rows(x, scale, shift, one) is not None) == taken
    assert (site.fast == 1) == taken and (sum(site.fallback.values()) == 1) != taken, site


def test_modulate_rows_refuses_what_changes_a_number(emulated_kernels):
    """fp32 rows over a bf16 tensor (eager promotes), a non-contiguous tensor, an integer literal other than one, a
    non-tensor: each runs as written."""
    x, rows = _rand(2, 24, 64), _rand(2, 1, 64)
    for first, second, shift, one in ((x, rows.float(), rows, 1), (x.transpose(0, 1), rows[:1], rows[:1], 1),
                                      (x, rows, rows, 2), (x, 0.5, rows, 1)):
        site = Site("modulate_scale_shift")
        want = _written(first, second, shift, one, True)
        got = NS.modulate_rows(first, second, shift, site, one, True)
        assert torch.equal(got, want) and got.dtype == want.dtype and site.fast == 0


def test_gated_residual_roles_told_by_the_shapes(emulated_kernels):
    """``R + E * torch.sigmoid(1 - g).unsqueeze(1)`` (Stable Audio 3): the syntax takes E for the gate; the call
    swaps them by their shapes (the product commutes exactly) and runs fused."""
    gen = torch.Generator().manual_seed(3)
    residual, update, g = _rand(2, 24, 64, gen=gen), _rand(2, 24, 64, gen=gen), _rand(2, 64, gen=gen)
    gate = torch.sigmoid(1 - g).unsqueeze(1)
    site = Site("gated_residual")
    got = NS.gated_residual(residual, update, gate, site)
    assert torch.equal(got, residual + update * gate) and site.fast == 1, site


def test_silu_product_written_either_way_round(emulated_kernels):
    """``y * act(x)`` (diffusers' SwiGLU) as the fused ``act(x) * y``; operands of two shapes as written."""
    gen = torch.Generator().manual_seed(4)
    x, y, act = _rand(1, 24, 64, gen=gen), _rand(1, 24, 64, gen=gen), torch.nn.SiLU()
    site = Site("silu_mul")
    assert torch.equal(NS.mul_silu(y, act, x, site), y * act(x)) and site.fast == 1
    assert torch.equal(NS.mul_silu(y[:, :1], None, x, site), y[:, :1] * torch.nn.functional.silu(x))
    assert site.fast == 1 and sum(site.fallback.values()) == 1
    packed = Site("silu_mul")  # Cosmos 3's packed [N, D] rows
    assert torch.equal(NS.mul_silu(y[0], act, x[0], packed), y[0] * act(x[0])) and packed.fast == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["minimax-h3", "ltx2", "krea2", "sana-wm"])
def test_modulate_rows_at_full_size_match_eager_bitwise(case, dtype):
    """The mappings with the real kernel at the families' shapes: MiniMax-H3 (5376 wide, rows chosen per token by
    ``index_select``), LTX-2's a2v / v2a (4096 wide, per-token ``[B, S, 1, D]`` rows squeezed), Krea 2 (6144 wide,
    ``(1.0 + s) * norm(x) + t``, per-sample rows), SANA-WM's per-frame rows (2240 wide). The output is written by the
    kernel into a fresh tensor: compared whole with eager."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    gen = torch.Generator(device="cuda").manual_seed(11)
    if case == "minimax-h3":
        x, table = _rand(1, 4680, 5376, dtype=dtype, device="cuda", gen=gen), _rand(2, 12, 5376, dtype=dtype,
                                                                                    device="cuda", gen=gen)
        rows = torch.randint(0, 12, (4680,), generator=gen, device="cuda")
        args = (x, table[0].index_select(0, rows), table[1].index_select(0, rows), 1.0, True)
    elif case == "ltx2":
        x, table = _rand(2, 6144, 4096, dtype=dtype, device="cuda", gen=gen), _rand(2, 2, 6144, 1, 4096, dtype=dtype,
                                                                                    device="cuda", gen=gen)
        args = (x, table[0].squeeze(2), table[1].squeeze(2), 1, True)
    elif case == "krea2":
        x, table = _rand(2, 4608, 6144, dtype=dtype, device="cuda", gen=gen), _rand(2, 6, 6144, dtype=dtype,
                                                                                    device="cuda", gen=gen)
        scale, shift = table[:, None].unbind(-2)[:2]
        args = (scale, x, shift, 1.0, False)
    else:
        x, table = _rand(1, 21, 3600, 2240, dtype=dtype, device="cuda", gen=gen), _rand(2, 1, 21, 1, 2240, dtype=dtype,
                                                                                        device="cuda", gen=gen)
        args = (x, table[0], table[1], 1, True)
    first, second, shift, one, normed_left = args
    want = _written(first, second, shift, one, normed_left)
    site = Site("modulate_scale_shift")
    got = NS.modulate_rows(first, second, shift, site, one, normed_left)
    assert torch.equal(got, want) and site.fast == 1 and not site.fallback, site
