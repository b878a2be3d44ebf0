"""group_norm_silu_conv: a GroupNorm VAE's norm -> SiLU -> convolution with the norm written channels-last.

On the GPU: the channels-last norm kernel against ``F.group_norm`` (then ``F.silu``) at the shapes of a FLUX.1 decode
at 1024x1024 and at odd ones (channel tiles across groups, positions past a tile), both input layouts, the output
poisoned through the allocator; the op against the eager chain at FLUX.1's convolutions (its first-call check, then
fresh inputs); the tiny FLUX.1 VAE's decode and encode equal to unpatched with every joined call fast. On the CPU:
the guard's reasons (each refusal the module calls as written, counted), the verification's fallback, the hooks.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from test_group_norm_silu import make_inputs
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath.models.vae_conv import FastpathConv2d
from diffusers_fastpath.ops import Site
from diffusers_fastpath.ops.conv_bias import SITE as CONV_SITE
from diffusers_fastpath.testing import build_flux_vae

gn = importlib.import_module("diffusers_fastpath.ops.group_norm_silu")
gnc = importlib.import_module("diffusers_fastpath.ops.group_norm_silu_conv")

DTYPES = [torch.bfloat16, torch.float16]
# FLUX.1's decode at 1024x1024: the norms before its convolutions (512 channels at 128^2 .. 128 at 1024^2); odd ones:
# 96 channels in 32 groups (3 per group: a 64-channel tile spans 22 groups, the second tile half full), 40 in 8 (5
# per group, one tile short of 64 channels), 24x40 and 3x8 positions (past and short of a 64-position tile), a batch
# of 2
CL_SHAPES = [(1, 512, 128, 128), (1, 512, 512, 512), (1, 256, 1024, 1024), (1, 128, 1024, 1024),
             (2, 96, 24, 40), (1, 40, 3, 8), (2, 64, 16, 16)]
# (shape, groups): a group wider than a tile (96 channels each: a tile starts inside one), a group per channel (a tile
# spans 64 groups, its statistics' table full)
CL_GROUPS = [((1, 192, 16, 16), 2), ((1, 64, 8, 8), 64)]


def _inputs(shape, dtype, seed, groups=None):
    channels = shape[1]
    groups = groups or (8 if channels % 32 else 32)
    return make_inputs(shape, dtype, "cuda", seed, groups)


def _conv(channels, out_channels, dtype, seed, device="cuda"):
    """A 3x3 convolution with padding 1 as the VAE's (``FastpathConv2d`` with the sites `patch` gives it)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    conv = FastpathConv2d(channels, out_channels, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * 0.05)
        conv.bias.copy_(torch.randn(conv.bias.shape, generator=gen) * 0.2)
    conv = conv.to(device=device, dtype=dtype).requires_grad_(False)
    conv.__dict__[CONV_SITE] = Site("conv_bias")
    return conv


# --- GPU ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, groups", [(shape, None) for shape in CL_SHAPES] + CL_GROUPS, ids=str)
def test_channels_last_kernel_equals_eager(shape, groups, dtype, silu, layout):
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    for seed in range(2):  # fresh inputs each round
        norm, x = _inputs(shape, dtype, seed, groups)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        ref = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
        ref = F.silu(ref) if silu else ref
        variant = gn._platform_variant(x.device, x.dtype)
        torch.full((ref.numel(),), float("nan"), device="cuda", dtype=dtype)  # poisons the block the output gets
        out = gn.raw_channels_last(x, norm.weight, norm.bias, norm.num_groups, norm.eps, silu, variant)
        torch.cuda.synchronize()
        assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == x.shape
        assert torch.equal(out, ref), (shape, dtype, silu, (out.float() - ref.float()).abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channels_last_kernel_through_nvrtc_equals_nvcc(dtype):
    """The NVRTC launcher (the Python twin of the .cu's grid and arguments) against the nvcc extension's op."""
    from diffusers_fastpath.ops import _build, _nvrtc

    if _build.load_extension() != "nvcc":
        pytest.skip("needs the nvcc extension beside NVRTC")
    major, minor = torch.cuda.get_device_capability()
    _nvrtc.build(_build.csrc_dir(), _build.cache_root(), f"{major}{minor}", _build.NVRTC_FLAGS)
    for shape in [(1, 512, 128, 128), (2, 96, 24, 40), (1, 40, 3, 8)]:
        norm, x = _inputs(shape, dtype, 5)
        variant = gn._platform_variant(x.device, x.dtype)
        nvcc = torch.ops.diffusers_fastpath._group_norm_silu_cl_cuda(x, norm.weight, norm.bias, norm.num_groups,
                                                                      norm.eps, True, variant)
        nvrtc = gn._nvrtc_cl(x, norm.weight, norm.bias, norm.num_groups, norm.eps, True, variant)
        assert torch.equal(nvcc, nvrtc) and nvrtc.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, out_channels", [((1, 512, 128, 128), 512), ((1, 256, 512, 512), 256),
                                                 ((1, 128, 1024, 1024), 3), ((2, 96, 24, 40), 64)], ids=str)
@torch.no_grad()
def test_op_equals_the_eager_chain_and_runs_fast(shape, out_channels, dtype):
    norm, x = _inputs(shape, dtype, 11)
    conv, act = _conv(shape[1], out_channels, dtype, 12), nn.SiLU()
    site = Site("group_norm_silu_conv")
    for seed in range(3):  # the first call checks the signature, the others run on it
        if seed:
            x = _inputs(shape, dtype, 11 + seed)[1]
        ref = nn.Conv2d.forward(conv, F.silu(F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)))
        out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
        assert out.is_contiguous() and torch.equal(out, ref), (shape, dtype, seed)
    assert site.fast == 3 and not site.fallback, site
    assert gnc.GROUP_NORM_SILU_CONV.disabled is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
@pytest.mark.parametrize("channels", [(32, 32, 64, 64), (8, 8, 8, 8)], ids=["wide", "narrow"])
def test_tiny_vae_decode_and_encode_equal_unpatched_on_gpu_every_joined_call_fast(channels, dtype, unpatch_after):
    """A small VAE of 32 and 64 channels: every joined call fast, through several calls of each signature (the decode
    and the encode twice, on other inputs); of 8 channels (the tiny test VAE's, where cuDNN's channels-last engine is
    not eager's): no joined call, the pair and the convolution fast apart. Equal to unpatched both ways."""
    vae = build_flux_vae("flux-tiny", dtype, "cuda", latent_channels=4, block_out_channels=channels,
                         norm_num_groups=8 if channels[0] == 32 else 4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    zs = [torch.randn(1, 4, 16, 16, generator=gen, device="cuda").to(dtype) for _ in range(2)]
    xs = [(torch.rand(2, 3, 96, 128, generator=gen, device="cuda") * 2 - 1).to(dtype) for _ in range(2)]
    ref_dec, ref_enc = [vae.decode(z).sample for z in zs], [vae.encode(x).latent_dist.mean for x in xs]
    unpatch_after(fp.patch(vae))
    for z, x, dec, enc in zip(zs, xs, ref_dec, ref_enc):
        assert torch.equal(vae.decode(z).sample, dec)
        assert torch.equal(vae.encode(x).latent_dist.mean, enc)
    chains = [r for r in fp.report(vae).sites if r.op == "group_norm_silu_conv"]
    if channels[0] == 32:
        assert chains and all(r.fast == 2 and r.fallback == 0 for r in chains), str(fp.report(vae))
        residual = [r for r in fp.report(vae).sites if r.op == "conv_bias_residual"]
        assert any(r.fast for r in residual), str(fp.report(vae))  # (conv2's pending result added to the input)
        assert all(set(r.reasons) <= {"residual not contiguous"} for r in residual), str(fp.report(vae))
    else:  # (no joined call where the convolutions are narrower than the op takes: `takes`)
        assert not chains and not [r for r in fp.report(vae).sites if r.op == "conv_bias_residual"]
        pairs = [r for r in fp.report(vae).sites if r.op == "group_norm_silu"]
        assert all(r.fast == 2 for r in pairs), str(fp.report(vae))
    assert gnc.GROUP_NORM_SILU_CONV.disabled is None


# --- CPU: the guard, the fallbacks, the hooks -------------------------------------------------------------------------


def _cpu_chain(dtype=torch.bfloat16, channels=64):
    gen = torch.Generator().manual_seed(0)
    norm = nn.GroupNorm(min(32, channels // 2), channels, eps=1e-6).to(dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(channels, generator=gen))
        norm.bias.copy_(0.2 * torch.randn(channels, generator=gen))
    x = torch.randn(1, channels, 16, 16, generator=gen).to(dtype)
    return norm, nn.SiLU(), _conv(channels, 32, dtype, 1, "cpu"), x


@pytest.mark.parametrize("case, reason", [
    ("gelu", "GELU is not nn.SiLU"),
    ("8 channels", "fewer than 32 channels"),
    ("5d", "x not 4-D"),
    ("fp32", "dtype float32"),
    ("no bias", "no bias"),
    ("channels-last weight", "weight layout"),
    ("benchmark", "cudnn.benchmark"),
])
@torch.no_grad()
def test_guard_refuses_with_the_reason_and_the_module_calls_run(case, reason, emulated_kernels, monkeypatch):
    norm, act, conv, x = _cpu_chain(torch.float32 if case == "fp32" else torch.bfloat16)
    if case == "gelu":
        act = nn.GELU()
    elif case == "8 channels":
        norm, act, conv, x = _cpu_chain(channels=8)
    elif case == "5d":
        x = x.unsqueeze(2)
        conv = _conv(64, 32, torch.bfloat16, 1, "cpu")
    elif case == "no bias":
        conv.bias = None
    elif case == "channels-last weight":
        conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    elif case == "benchmark":
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert gnc.GROUP_NORM_SILU_CONV.guard(norm, act, conv, x, None) == reason
    site = Site("group_norm_silu_conv")
    if case == "5d":
        return  # (the module calls would fail on a 5-D x with a 2-D convolution: the guard's answer is the point)
    out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
    assert torch.equal(out, conv(act(norm(x)))) and site.fallback == {reason: 1} and site.fast == 0


@torch.no_grad()
def test_the_emulated_chain_is_fast_and_equal(emulated_kernels):
    norm, act, conv, x = _cpu_chain()
    site = Site("group_norm_silu_conv")
    out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
    assert torch.equal(out, conv(act(norm(x)))) and out.is_contiguous() and site.fast == 1


@torch.no_grad()
def test_a_mismatch_disables_the_op_and_the_module_calls_give_eagers_bits(emulated_kernels, monkeypatch, fastpath_log):
    norm, act, conv, x = _cpu_chain()
    monkeypatch.setattr(gnc, "_norm_channels_last", lambda norm, x: (gn.group_norm_silu_ref(norm, x) * 1.01).contiguous(
        memory_format=torch.channels_last))
    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "disabled", None)
    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "verified", set())
    site = Site("group_norm_silu_conv")
    out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
    assert torch.equal(out, conv(act(norm(x)))) and site.fast == 0
    assert gnc.GROUP_NORM_SILU_CONV.disabled is not None
    out = gnc.group_norm_silu_conv(norm, act, conv, x, site)  # disabled: the module calls, counted
    assert torch.equal(out, conv(act(norm(x)))) and site.fast == 0 and sum(site.fallback.values()) == 2


@torch.no_grad()
def test_the_proof_disables_a_chain_that_differs_on_the_wide_input_only(emulated_kernels, monkeypatch):
    """An engine that agrees with eager on the call's own input and not on another one (`probe`): the first call's
    proof finds it, the op is disabled, and every result is eager's."""
    norm, act, conv, x = _cpu_chain()
    own = x.clone()

    def kernel(norm, act, conv, x, causal=None, pending=False):
        out = gnc.group_norm_silu_conv_ref(norm, act, conv, x)
        return out if torch.equal(x, own) else out + 1

    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "kernel", kernel)
    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "prove", None)
    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "disabled", None)
    monkeypatch.setattr(gnc.GROUP_NORM_SILU_CONV, "verified", set())
    site = Site("group_norm_silu_conv")
    out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
    assert torch.equal(out, conv(act(norm(x)))) and site.fast == 0
    assert "not bit-exact" in gnc.GROUP_NORM_SILU_CONV.disabled


def test_probe_inputs_spread_their_values_over_binades_and_keep_the_layout():
    from diffusers_fastpath.ops._policy import probe_seeds, wide_like

    x = torch.zeros(1, 32, 16, 16, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    values = wide_like(x)
    assert values.stride() == x.stride() and values.dtype == x.dtype
    magnitudes = values.float().abs()
    assert magnitudes.max() > 64 and magnitudes[magnitudes > 0].min() < 1 / 64
    assert torch.equal(values, wide_like(x)) and not torch.equal(values, wide_like(x, 1))
    assert list(probe_seeds(x)) == [0, 1, 2] and list(probe_seeds(torch.zeros(2, 1 << 20))) == [0]


@torch.no_grad()
def test_a_hooked_module_of_the_chain_runs_the_module_calls_with_their_hooks(emulated_kernels):
    norm, act, conv, x = _cpu_chain()
    seen = []
    handle = conv.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    try:
        site = Site("group_norm_silu_conv")
        out = gnc.group_norm_silu_conv(norm, act, conv, x, site)
        assert torch.equal(out, nn.Conv2d.forward(conv, act(norm(x)))) and seen == [True] and site.fast == 0
    finally:
        handle.remove()


# --- CPU: the residual add that takes the joined call's pending result (FLUX.1's resnets) ----------------------------


def _rewritten(source: str, rewrite) -> str:
    """The function in `source` with its body put through ``rewrite(body)``, as text."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    func = tree.body[0]
    func.body = rewrite(func.body)
    return ast.unparse(ast.fix_missing_locations(tree))


def _pending_rewrite(source: str) -> str:
    from diffusers_fastpath.models.vae_ltx2_chain import _Pending

    return _rewritten(source, lambda body: _Pending("ns", body, False, True).body(body))


def test_the_divided_residual_add_before_the_return_takes_the_pending_result():
    out = _pending_rewrite('''
        def forward(self, x, y):
            x = ns.norm_act_conv(self, 'n', 'a', (), 'c', x)
            if self.shortcut is not None:
                y = self.shortcut(y)
            out = (y + x) / self.scale
            return out
        ''')
    assert "x = ns.norm_act_conv_pending(self, 'n', 'a', (), 'c', x)" in out
    assert "out = ns.pending_add(self, y, x) / self.scale" in out


@pytest.mark.parametrize("tail", [
    "out = (y + x) / self.scale\n    z = out * 2\n    return z",  # not returned at once: x could be read later
    "out = (y + x) / x.sum()\n    return out",  # the divisor reads the pending value
    "out = (y + x) * self.scale\n    return out",  # not a division
])
def test_other_forms_of_the_residual_add_leave_the_value_a_tensor(tail):
    out = _pending_rewrite("def forward(self, x, y):\n    x = ns.norm_act_conv(self, 'n', 'a', (), 'c', x)\n    " + tail)
    assert "pending" not in out



# --- CPU: the rewrite's moves (the pair into an ``if`` chain's branches; a branch that raises) ------------------------


def _resnet(**kwargs):
    from diffusers.models.resnet import ResnetBlock2D

    gen = torch.Generator().manual_seed(0)
    block = ResnetBlock2D(in_channels=32, out_channels=32, groups=8, eps=1e-6, **kwargs).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 and p is not None else 0.0))
    return block


@pytest.mark.parametrize("kwargs, temb", [
    (dict(temb_channels=None, up=True), False),  # conv1 behind the upsampling branch
    (dict(temb_channels=None, down=True), False),  # ... the downsampling branch
    (dict(temb_channels=None), False),  # ... the else: branch, joined
    (dict(temb_channels=16, time_embedding_norm="scale_shift"), True),  # conv2 in the raising branch's path
    (dict(temb_channels=16), True),  # the default branch, temb added
])
@torch.no_grad()
def test_the_rewritten_resnet_runs_every_branch_as_diffusers_writes_it(kwargs, temb):
    """The rewritten ``ResnetBlock2D.forward`` on modules without sites (each joined call runs its statements as
    written) gives diffusers' result bit for bit on every branch the move touched."""
    from diffusers_fastpath.models.vae_kl import BLOCKS

    block = _resnet(**kwargs)
    x = torch.randn(2, 32, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.randn(2, 16, generator=torch.Generator().manual_seed(2)) if temb else None
    ref = block(x, t)
    (resnet,) = [b for b in BLOCKS if b.base.__name__ == "ResnetBlock2D"]
    block.__class__ = resnet.current()
    assert torch.equal(block(x, t), ref)


def test_the_scale_shift_branch_still_raises_without_temb():
    from diffusers_fastpath.models.vae_kl import BLOCKS

    block = _resnet(temb_channels=None, time_embedding_norm="scale_shift")
    (resnet,) = [b for b in BLOCKS if b.base.__name__ == "ResnetBlock2D"]
    block.__class__ = resnet.current()
    with pytest.raises(ValueError, match="temb"):
        block(torch.randn(1, 32, 8, 8), None)


def _chains(source: str) -> str:
    from diffusers_fastpath.models.vae_ltx2_chain import _Chains

    return _rewritten(source, _Chains("ns", None).body)


PAIR = "x = ns.norm_act(self, 'n', 'a', x)"


def test_a_pair_moves_into_an_if_chain_of_hoistable_tests_and_joins_on_the_branch_without_statements():
    out = _chains(f"""
        def forward(self, x):
            {PAIR}
            if self.up is not None:
                x = self.up(x)
            elif self.down is not None:
                try:
                    raise ValueError
                except ValueError:
                    x = self.down(x)
            x = self.conv(x)
            return x
        """)
    # each branch: the pair, its statements, the convolution; joined where only module calls of x lie between (the
    # between modules' run-time check, `vae.between_reason`, takes nothing but an eval-mode nn.Dropout there)
    assert "x = ns.norm_act_conv(self, 'n', 'a', ('up',), 'conv', x)" in out
    assert out.count("ns.norm_act(self, 'n', 'a', x)") == 1  # the try branch: the pair as written
    assert "else:\n        x = ns.norm_act_conv(self, 'n', 'a', (), 'conv', x)" in out


@pytest.mark.parametrize("middle", [
    "if self.up is not None and x.shape[0] > 1:\n        x = self.up(x)",  # a test that reads x: not hoistable
    "if self.flag:\n        x = self.up(x)",  # not an `is None` test of the block's own attribute
    "if self.up is not None:\n        return x",  # a branch that leaves early
    "for i in range(2):\n        x = self.up(x)",  # not an if
])
def test_a_pair_stays_where_it_is_unless_the_move_is_provably_the_same_statements(middle):
    out = _chains(f"def forward(self, x):\n    {PAIR}\n    {middle}\n    x = self.conv(x)\n    return x")
    assert "norm_act_conv" not in out and out.count("ns.norm_act(self") == 1


def test_a_statement_between_the_if_and_the_convolution_keeps_the_pair_apart():
    out = _chains(f"""
        def forward(self, x):
            {PAIR}
            if self.up is not None:
                x = self.up(x)
            y = x * 2
            x = self.conv(y)
            return x
        """)
    assert "norm_act_conv" not in out



def test_joined_call_sites_go_to_convolutions_the_op_can_take():
    from diffusers_fastpath.models.vae_conv import FastpathConv2d, joins_group_norm

    wide, narrow, odd = FastpathConv2d(32, 8, 3), FastpathConv2d(8, 8, 3), FastpathConv2d(36, 8, 3)
    assert joins_group_norm(wide) and not joins_group_norm(narrow) and not joins_group_norm(odd)
    assert not joins_group_norm(nn.Conv2d(32, 8, 3))
