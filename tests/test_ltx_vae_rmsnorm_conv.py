"""LTX-Video's VAE norm -> SiLU -> causal convolution as one op (ops/ltx_vae_rmsnorm_conv.py: the norm's multiply, cast
and SiLU written straight into the convolution's padded channels-last input by csrc/causal_pad.cu's
ltx_rmsnorm_pad_cl_kernel; the joined call of models/vae_ltx2_chain.py in LTX-Video's form). On CPU: the kernel's
arithmetic against the eager modules' padded input, the op against the modules (causal and not, x with its channels
apart), the wrapper's launch, the rewrite's bare-call rule, the refusals (hooks on each module, a dropout in training
mode, fp32, no bias, another activation) run as written, the tail's proof and a planted mismatch in it, the NVRTC
launcher and raw guard. The VAE-level tests (every site, tiling, counts) are in test_vae_ltx.py. On the GPU: the op at
the decoder's real shapes (bf16 / fp16, contiguous and sliced x, outputs poisoned first), the kernel through NVRTC and
nvcc against eager, and the tail's proof on every value."""

from __future__ import annotations

import ast
import importlib
import textwrap

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.normalization import RMSNorm
from torch import nn

import diffusers_fastpath as fp
from diffusers_fastpath._state import SITE_ATTR
from diffusers_fastpath.models import vae_ltx, vae_ltx2_chain, vae_ltx_conv
from diffusers_fastpath.ops._policy import REASON_DISABLED, Site, bits, tensors_equal
from diffusers_fastpath.testing._common import randomize_
from test_vae_ltx import _build, _decode, _latents

chain = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm_conv")  # (ops binds the names to the ops)
ltx_norm = importlib.import_module("diffusers_fastpath.ops.ltx_vae_rmsnorm")
causal_conv_pad = importlib.import_module("diffusers_fastpath.ops.causal_conv_pad")
OP = chain.LTX_VAE_RMSNORM_CONV


def _modules(cin=16, cout=8, causal=True, dtype=torch.bfloat16, seed=1, bias=True):
    """A patched norm, an ``nn.SiLU`` and a patched ``LTXVideoCausalConv3d`` (what the adapter makes of them)."""
    norm = RMSNorm(cin, eps=1e-8, elementwise_affine=False)
    norm.__class__ = vae_ltx.FastpathLTXRMSNorm
    conv = randomize_(ltx.LTXVideoCausalConv3d(cin, cout, 3, is_causal=causal), seed).to(dtype)
    if not bias:
        conv.conv.bias = None
    conv.__class__ = vae_ltx_conv.FastpathLTXVideoCausalConv3d
    conv.__dict__[SITE_ATTR] = Site("ltx_causal_conv3d")
    return norm, nn.SiLU(), conv


def _x(shape=(2, 16, 3, 4, 8), dtype=torch.bfloat16, sliced=False, seed=2):
    """x ``[B, C, T, H, W]``: contiguous, or with its first frame sliced off (channels apart, as the upsamplers leave
    it); zeros scattered and one position whose channels are all zero (rsqrt of eps)."""
    b, c, t, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, c, t + sliced, h, w, generator=gen) * 3).to(dtype)
    x = x[:, :, 1:] if sliced else x
    x[:, 1::5, ..., ::3] = 0
    x[0, :, 0, 0, 0] = 0
    return x


def _eager(norm, act, conv, x):
    """The block's statements: the norm on the channel-last view, moved back, the SiLU, the convolution's call."""
    return conv(act(ltx_norm.ltx_rmsnorm_ref(norm, x.movedim(1, -1)).movedim(-1, 1)))


# --- the arithmetic and the op on CPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_arithmetic_is_the_padded_input_eager_convolves(sliced, causal, dtype):
    """`norm_pad_arithmetic` (the kernel's documentation in code) on x and aten's reciprocal is, bit for bit and in
    layout (channels-last), what eager's convolution reads: the module's own padding statements (the first frame
    repeated, or the first and the last) of the SiLU of the norm."""
    norm, act, conv = _modules(causal=causal, dtype=dtype)
    x = _x(dtype=dtype, sliced=sliced)
    view = x.movedim(1, -1)
    y = act(RMSNorm.forward(norm, view).movedim(-1, 1))
    k = conv.kernel_size[0]
    if causal:
        want = torch.concatenate([y[:, :, :1].repeat((1, 1, k - 1, 1, 1)), y], dim=2)
    else:
        want = torch.concatenate([y[:, :, :1].repeat((1, 1, (k - 1) // 2, 1, 1)), y,
                                  y[:, :, -1:].repeat((1, 1, (k - 1) // 2, 1, 1))], dim=2)
    padding, _, reflect = chain._conv._plan(conv, None)
    r = ltx_norm.reciprocal(view, norm.eps).contiguous().view(x.shape[0], -1)
    got = chain.norm_pad_arithmetic(x, r, padding, reflect)
    assert got.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(bits(got), bits(want))


@torch.no_grad()
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_op_equals_the_modules(sliced, causal, emulated_kernels):
    """The op (its own code: aten's reciprocal with the squares kernel where x is dense, the launch, the convolution
    channels-last) equals the block's statements, its first call checked against eager (the site fast, the
    signature verified)."""
    norm, act, conv = _modules(causal=causal)
    x = _x(sliced=sliced)
    ref = _eager(norm, act, conv, x)
    site = Site(OP.name)
    out = chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site)
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert site.fast == 1 and not site.fallback and OP.disabled is None
    assert {key[0] for key in OP.verified} == {("bfloat16", "strided" if sliced else "dense")}


def test_kernel_wrapper_hands_the_launch_what_it_takes(monkeypatch, emulated_kernels):
    """`_kernel` gives the launch x as it is (channels apart too), aten's reciprocal as contiguous ``[B, T*H*W]`` fp32
    rows, the convolution's time padding (causal: k - 1 frames before; non-causal: one each side) and no reflection."""
    seen = []

    def launch(x, r, padding, reflect_hw):
        seen.append((x.data_ptr(), x.stride(), tuple(r.shape), r.dtype, r.is_contiguous(), list(padding), reflect_hw))
        return chain.norm_pad_arithmetic(x, r, padding, reflect_hw)

    monkeypatch.setattr(chain, "_launch", launch)
    for causal, padding in ((True, [0, 0, 0, 0, 2, 0]), (False, [0, 0, 0, 0, 1, 1])):
        norm, act, conv = _modules(causal=causal)
        x = _x(sliced=True)
        seen.clear()
        assert torch.equal(chain._kernel(norm, act, conv, x), _eager(norm, act, conv, x))
        assert seen == [(x.data_ptr(), x.stride(), (2, 3 * 4 * 8), torch.float32, True, padding, False)]


@torch.no_grad()
def test_guard_refuses_what_the_kernel_does_not_take():
    """Refused with the reason (never raised): another activation, fp32 (the norm's kernels refuse it, as the
    convolution's channels-last path does), a convolution without bias (its channels-first path), x not 5-D, a
    weighted norm, x's layout the norm's kernel does not read; a CPU x passes every other check (the device last)."""
    norm, act, conv = _modules()
    x = _x()
    assert OP.guard(norm, act, conv, x) == "device cpu"
    assert OP.guard(norm, nn.GELU(), conv, x) == "GELU is not nn.SiLU"
    assert OP.guard(norm, act, conv, x.float()) == "dtype float32"
    assert OP.guard(norm, act, _modules(bias=False)[2], x) == "the convolution's channels-first path"
    assert OP.guard(norm, act, conv, x[0]) == "x not [B, C, T, H, W]"
    assert OP.guard(norm, act, conv, "x") == "x not [B, C, T, H, W]"
    weighted = vae_ltx.FastpathLTXRMSNorm(16, eps=1e-8)
    assert OP.guard(weighted, act, conv, x) == "norm with weight or bias"
    assert OP.guard(norm, act, conv, x.contiguous(memory_format=torch.channels_last_3d)) == (
        "x not the channel-last view of channel-first memory")
    assert OP.guard(norm, act, conv, x, 1) == "causal not a bool"


@torch.no_grad()
@pytest.mark.parametrize("hooked", ["norm", "act", "conv", "inner"])
def test_hooks_on_any_module_refuse_and_the_modules_run(hooked, emulated_kernels):
    """The op stands for the three module calls: a hook on the norm, the SiLU, the convolution (or its inner
    ``nn.Conv3d``) refuses it, counted, and the fallback calls the modules, so the hook runs and sees what it sees
    unpatched."""
    norm, act, conv = _modules()
    x = _x()
    ref = _eager(norm, act, conv, x)
    target = {"norm": norm, "act": act, "conv": conv, "inner": conv.conv}[hooked]
    seen = []
    handle = target.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    site = Site(OP.name)
    try:
        assert torch.equal(chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site), ref)
    finally:
        handle.remove()
    assert len(seen) == 1 and site.fast == 0
    reason = "the convolution has hooks" if hooked == "inner" else f"{type(target).__name__} has hooks"
    assert dict(site.fallback) == {reason: 1}


@torch.no_grad()
@pytest.mark.parametrize("planted", [None, 0x3F80, -0x0080, 0x7FC1, 0x0001], ids=str)
def test_a_tail_proof_that_fails_disables_the_op(planted, monkeypatch, emulated_kernels):
    """The proof runs the kernel on every bf16 value with the reciprocal 1 (`tail_probe`, against eager's chain,
    `tail_ref`) on the first call of a signature: one value off anywhere (1.0, -0.0, a NaN's payload, a subnormal)
    disables the op, that call's result eager's; the pair and the norm stay on."""
    def launch(x, r, padding, reflect_hw):
        out = chain.norm_pad_arithmetic(x, r, padding, reflect_hw)
        if planted is not None and not any(padding):  # (the proof's row: nothing padded, x's shape)
            bits(out)[bits(x) == planted] += 1
        return out

    monkeypatch.setattr(chain, "_launch", launch)
    monkeypatch.setattr(OP, "prove", chain._prove)
    norm, act, conv = _modules()
    x = _x(shape=(1, 16, 2, 2, 8))
    site = Site(OP.name)
    assert torch.equal(chain.ltx_vae_rmsnorm_conv(norm, act, conv, x, None, site), _eager(norm, act, conv, x))
    assert (site.fast == 1) is (planted is None), (site, OP.status)
    if planted is not None:
        assert "not bit-exact" in OP.disabled and dict(site.fallback) == {REASON_DISABLED: 1}
        assert ltx_norm.LTX_VAE_RMSNORM_SILU.disabled is None and ltx_norm.LTX_RMSNORM.disabled is None


def test_the_tail_probe_runs_the_kernel_on_a_row(monkeypatch):
    """`tail_probe` hands the kernel a ``[1, 1, 1, 1, n]`` x (any n: the kernel reads elements), a ``[1, n]`` fp32
    reciprocal of ones and no padding, and returns the row; `tail_ref` is eager's chain with that reciprocal."""
    seen = []

    def launch(x, r, padding, reflect_hw):
        seen.append((tuple(x.shape), tuple(r.shape), r.dtype, bool((r == 1).all()), list(padding), reflect_hw))
        return chain.norm_pad_arithmetic(x, r, padding, reflect_hw)

    monkeypatch.setattr(chain, "_launch", launch)
    row = torch.randn(1, 1, 65537).to(torch.float16)
    assert torch.equal(chain.tail_probe(row), F.silu(row))
    assert torch.equal(chain.tail_ref(row), F.silu(row))
    assert seen == [((1, 1, 1, 1, 65537), (1, 65537), torch.float32, True, [0] * 6, False)]


# --- the rewrite and the refusals in a VAE ------------------------------------------------------------------------


def _chains(code: str, keyword=None) -> str:
    body = ast.parse(textwrap.dedent(code)).body
    return ast.unparse(ast.fix_missing_locations(ast.Module(vae_ltx2_chain._Chains("ns", keyword).body(body), [])))


_PAIR = "x = ns.norm_act(self, 'n', 'a', x)"


def test_the_bare_call_that_ends_the_run_after_a_pair_is_joined():
    """LTX-Video's form (no argument names the convolution): the last ``V = self.X(V)`` of the run after the pair is
    taken for the convolution, the ones before it for the modules between; a call with an argument, another value's
    call or a statement that is no call ends the run; with a keyword (LTX-2's form) a bare call is not joined."""
    joined = "x = ns.norm_act_conv(self, 'n', 'a', ({}), '{}', x)"
    assert _chains(f"{_PAIR}\nx = self.c(x)\ny = 1") == joined.format("", "c") + "\ny = 1"
    assert _chains(f"{_PAIR}\nx = self.d(x)\nx = self.c(x)") == joined.format("'d',", "c")
    assert _chains(f"{_PAIR}\nx = self.c(x)\nx = self.c2(x, k=1)") == joined.format("", "c") + "\nx = self.c2(x, k=1)"
    assert _chains(f"{_PAIR}\nx = self.c(x)\ny = self.e(y)") == joined.format("", "c") + "\ny = self.e(y)"
    assert _chains(f"{_PAIR}\ny = self.c(x)") == f"{_PAIR}\ny = self.c(x)"
    assert _chains(f"{_PAIR}\nx = self.c(x)", "causal") == f"{_PAIR}\nx = self.c(x)"
    # across a branch that ends in the pair: the statements after the if move into both branches, joined in one
    code = f"if self.m is not None:\n    x = g(x)\nelse:\n    {_PAIR}\nx = self.d(x)\nx = self.c(x)"
    assert _chains(code).splitlines() == ["if self.m is not None:", "    x = g(x)", "    x = self.d(x)",
                                          "    x = self.c(x)", "else:", "    " + joined.format("'d',", "c")]


def test_the_blocks_forwards_join_each_pair_with_its_convolution():
    """The rewritten LTX-Video forwards: the resnet's two pairs joined with ``conv1`` and (past ``dropout``) ``conv2``,
    each norm_out with ``conv_out``, on the branch without the timestep modulate; nothing left pending; the modulated
    branches keep their statements."""
    import inspect

    resnet, encoder, decoder = (block.current() for block in vae_ltx.BLOCKS)
    assert vae_ltx2_chain._joined_convs(resnet.forward) == ("conv1", "conv2")
    assert vae_ltx2_chain._joined_convs(encoder.forward) == vae_ltx2_chain._joined_convs(decoder.forward) == (
        "conv_out",)
    source = inspect.getsource(resnet.forward)
    ns = "_diffusers_fastpath_vae_ltx"
    assert f"{ns}.norm_act_conv(self, 'norm2', 'nonlinearity', ('dropout',), 'conv2', hidden_states)" in source
    assert source.count("hidden_states = self.conv1(hidden_states)") == 1  # (the modulated branch's, as written)
    assert all("pending" not in inspect.getsource(b.forward) and "settled" not in inspect.getsource(b.forward)
               for b in (resnet, encoder, decoder))


def _chain_site(conv):
    return conv.__dict__[f"_fastpath_site_{OP.name}"]


@torch.no_grad()
def test_chain_refusals_in_the_vae_run_the_statements_as_written(emulated_kernels, unpatch_after):
    """In a patched VAE: a hook on a joined convolution (it sees the SiLU's result, as unpatched), a dropout in
    training mode (p 0: the identity, but not provably) refuse that chain, counted on its site; the pair then runs
    fused on its own site and the convolution's call; patched == unpatched; the other chains stay fast."""
    vae = _build()
    z = _latents(vae)
    seen = []
    resnet = vae.decoder.mid_block.resnets[0]

    def decode():
        handle = resnet.conv1.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
        resnet.dropout.train()
        try:
            return _decode(vae, z)
        finally:
            handle.remove()
            resnet.dropout.eval()

    ref, ref_seen = decode(), list(seen)
    seen.clear()
    unpatch_after(fp.patch(vae))
    assert torch.equal(decode(), ref) and len(seen) == len(ref_seen) == 1 and torch.equal(seen[0], ref_seen[0])
    assert dict(_chain_site(resnet.conv1).fallback) == {"FastpathLTXVideoCausalConv3d has hooks": 1}
    assert dict(_chain_site(resnet.conv2).fallback) == {"dropout in training mode": 1}
    assert resnet.norm1._fastpath_site_ltx_vae_rmsnorm_silu.fast == 1  # (the pair's own site, as written)
    assert resnet.norm2._fastpath_site_ltx_vae_rmsnorm_silu.fast == 1
    others = [r for r in fp.report(vae).sites if r.op == OP.name and r.site.startswith("decoder.")
              and ".mid_block.resnets.0." not in r.site]
    assert others and all(r.fast == 1 and not r.fallback for r in others), str(fp.report(vae))


@torch.no_grad()
def test_fp32_vae_chains_refuse_by_dtype(emulated_kernels, unpatch_after):
    """An fp32 VAE: every chain refused for its dtype (the norm's kernels, as the convolution's channels-last path),
    the statements as written; patched == unpatched."""
    vae = _build(dtype=torch.float32)
    z = _latents(vae).float()
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref)
    chains = [r for r in fp.report(vae).sites if r.op == OP.name and r.site.startswith("decoder.")]
    assert chains and all(r.fast == 0 and set(r.reasons) == {"dtype float32"} for r in chains), str(fp.report(vae))


# --- the NVRTC launcher ---------------------------------------------------------------------------------------------


def test_nvrtc_launcher_passes_what_bindings_cpp_passes(monkeypatch):
    """The NVRTC way's launch of csrc/causal_pad.cu's norm kernel: causal_pad's arguments (channels-last, the frames
    repeated, no cache, x's strides) and its channels-last grid, then the reciprocal's pointer; the output padded in
    time, channels-last."""
    from test_nvrtc import captured_launches  # noqa: F401 - the fixture's body, called directly below

    launches = captured_launches.__wrapped__(monkeypatch)
    x = _x((2, 40, 5, 9, 40))[:, :, 1:4]  # a time slice: strided frames
    r = torch.rand(2, 3 * 9 * 40)
    out = chain._nvrtc_kernel(x, r, [0, 0, 0, 0, 1, 1], False)
    kernel, key, grid, block, a = launches[-1]
    assert (kernel, key, block) == (chain._NVRTC, torch.bfloat16, (32, 8, 1))
    assert out.shape == (2, 40, 5, 9, 40) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert grid == (2, 2, 2 * 5 * 9)
    assert (a.a.out, a.a.x, a.a.cache, a.a.batch, a.a.channels, a.a.frames, a.a.height, a.a.width) == (
        out.data_ptr(), x.data_ptr(), None, 2, 40, 3, 9, 40)
    assert (a.a.cache_frames, a.a.pad_t0, a.a.pad_t1, a.a.pad_h0, a.a.pad_h1, a.a.pad_w0, a.a.pad_w1) == (
        0, 1, 1, 0, 0, 0, 0)
    assert (a.a.x_stride_b, a.a.x_stride_c, a.a.x_stride_t, a.a.x_stride_h) == x.stride()[:4]
    assert (a.a.dtype, a.a.channels_last, a.a.replicate_t, a.a.reflect_hw, a.rsqrt) == (
        1, True, True, False, r.data_ptr())
    out = chain._nvrtc_kernel(x.half(), r, [1, 1, 1, 1, 2, 0], True)
    kernel, key, grid, block, a = launches[-1]
    assert key == torch.float16 and out.shape == (2, 40, 5, 11, 42) and grid == (2, 2, 2 * 5 * 11)
    assert (a.a.dtype, a.a.pad_t0, a.a.pad_t1, a.a.pad_w0, a.a.reflect_hw) == (0, 2, 0, 1, True)


def test_raw_op_guard_refuses_what_bindings_cpp_refuses():
    class OnCuda(torch.Tensor):  # (the raw guard's device check, passed on a CPU)
        is_cuda = property(lambda self: True)

    x = torch.Tensor._make_subclass(OnCuda, _x((2, 8, 3, 4, 8)))
    r = torch.rand(2, 3 * 4 * 8)
    assert chain._raw_guard(x, r, [0, 0, 0, 0, 2, 0], False) is None
    assert chain._raw_guard(torch.Tensor._make_subclass(OnCuda, x.float()), r, [0, 0, 0, 0, 2, 0], False) == "dtype"
    assert chain._raw_guard(x, r[:, 1:], [0, 0, 0, 0, 2, 0], False) == "rsqrt"
    assert chain._raw_guard(x, r.double(), [0, 0, 0, 0, 2, 0], False) == "rsqrt"
    assert chain._raw_guard(x, r, [0, 0, 0, 0, 2], False) is not None
    assert chain._raw_guard(x, r, [8, 8, 0, 0, 2, 0], True) is not None  # (a reflection not below its size)
    assert chain._raw_guard(_x((2, 8, 3, 4, 8)), r, [0, 0, 0, 0, 2, 0], False) is not None  # (CPU)


# --- GPU ------------------------------------------------------------------------------------------------------------

# The chains of LTX-Video's decode at 768x512x121 (latents 16 frames of 16x24; the published 0.9.0 decoder,
# non-causal: the mid block at 512 channels, the up blocks at 512, 256 and 128 after each 2x upsampling, the last at
# the 4x4-patchified 128x192, 121 frames; norm_out -> conv_out 128 -> 48), as (x shape, convolution's out channels,
# causal); the encoder's (causal) at two of its shapes.
CHAIN_SHAPES = [((1, 512, 16, 16, 24), 512, False), ((1, 512, 31, 32, 48), 512, False),
                ((1, 256, 61, 64, 96), 256, False), ((1, 128, 121, 128, 192), 128, False),
                ((1, 128, 121, 128, 192), 48, False), ((1, 128, 121, 128, 192), 128, True),
                ((1, 512, 16, 16, 24), 512, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,out_channels,causal", CHAIN_SHAPES, ids=str)
@torch.no_grad()
def test_chain_equals_eager_at_ltx_video_decoder_shapes(shape, out_channels, causal, dtype, layout):
    """The op (its kernel, the tail's proof and its first-call check included) against diffusers' modules called as
    the blocks call them, bit for bit (`tensors_equal`), strides included, the allocator's blocks of the padded buffer's
    size poisoned with NaN first; x contiguous or with its first frame sliced off (the upsamplers' ``[:, :, 1:]``:
    channels apart), zeros scattered and an all-zero position (rsqrt of eps)."""
    from diffusers_fastpath.models.vae import checked_forwards
    from diffusers_fastpath.ops.ltx_causal_conv import add_conv_class

    ltx_norm.add_norm_class(RMSNorm)
    checked_forwards([ltx.LTXVideoCausalConv3d], vae_ltx_conv.CONV_DIGESTS, register=add_conv_class)
    conv = ltx.LTXVideoCausalConv3d(shape[1], out_channels, 3, is_causal=causal)
    conv = randomize_(conv, sum(shape) % 1000).to("cuda", dtype).eval()
    norm, act = RMSNorm(shape[1], eps=1e-8, elementwise_affine=False).cuda(), nn.SiLU()
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + out_channels)
    x = (torch.randn(b, c, t + (layout == "sliced"), h, w, generator=gen, device="cuda") * 3).to(dtype)
    x = x[:, :, 1:] if layout == "sliced" else x
    x[:, 1::5, ..., ::11] = 0
    x[0, :, 0, 0] = 0
    ref = conv(act(norm(x.movedim(1, -1)).movedim(-1, 1)))
    padded = b * c * (t + 2) * h * w
    torch.full((2 * padded,), float("nan"), dtype=dtype, device="cuda")  # (freed: the next blocks hold NaN)
    torch.cuda.synchronize()
    site = Site(OP.name)
    out = OP(site, norm, act, conv, x, None)
    assert site.fast == 1, (dict(site.fallback), OP.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref) and ref.isfinite().float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.no_grad()
def test_the_tail_proof_passes_on_every_value(dtype):
    """The kernel with the reciprocal 1 equals eager's chain (`tail_ref`) on all 65536 values of the dtype (NaN
    payloads, infinities, subnormals), as the op's proof runs it."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    assert chain._prove(None, None, None, torch.zeros(1, 8, 1, 1, 8, dtype=dtype, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 121, 128, 192), (2, 33, 3, 7, 37), (1, 8, 1, 2, 2)], ids=str)
@torch.no_grad()
def test_kernel_through_nvrtc_equals_nvcc_and_eager(shape, dtype):
    """csrc/causal_pad.cu's norm kernel through NVRTC and through the nvcc extension (where a toolkit built it)
    against eager's chain (the norm, the SiLU, the module's padding statements; for "reflect" F.pad's), causal and
    not, "zeros" and "reflect", x contiguous and a strided time slice, every element written (poisoned first); at
    LTX-Video's largest norm, and at odd shapes (channels and columns no multiple of the 32 x 32 tile; one frame)."""
    from test_ltx_causal_conv import _eager_buffer
    from test_nvrtc import both_ways

    nvcc = both_ways.__wrapped__()
    b, c, t, h, w = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(b, c, t + 2, h, w, generator=gen, device="cuda") * 3).to(dtype)
    norm = RMSNorm(c, eps=1e-8, elementwise_affine=False)
    for view in (x[:, :, 1:1 + t], x[:, :, :t].contiguous()):
        r = ltx_norm.reciprocal(view.movedim(1, -1), norm.eps).contiguous().view(b, -1)
        y = F.silu(RMSNorm.forward(norm, view.movedim(1, -1)).movedim(-1, 1))
        for mode in ("zeros", "reflect"):
            conv = ltx.LTXVideoCausalConv3d(c, 4, 3, padding_mode=mode)
            for causal in (True, False):
                conv.is_causal = causal
                padding, _, reflect = chain._conv._plan(conv, None)
                want = _eager_buffer(conv, y, causal)
                ways = [chain._nvrtc_kernel] + ([torch.ops.diffusers_fastpath._ltx_rmsnorm_pad_cl_cuda] if nvcc else [])
                for way in ways:
                    torch.full((2 * want.numel(),), float("nan"), dtype=dtype, device="cuda")
                    out = way(view, r, padding, reflect)
                    assert out.is_contiguous(memory_format=torch.channels_last_3d), (way, mode, causal)
                    assert out.shape == want.shape and torch.equal(bits(out), bits(want)), (way, mode, causal)
