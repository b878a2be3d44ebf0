"""The LTX-2 VAE adapter (models/vae_ltx2.py): tiny bf16 ``AutoencoderKLLTX2Video`` (the published block structure,
8 channels; its timestep-conditioned decoder too), decode and encode patched == unpatched (``torch.equal``) with
every site on its fast path (on CPU under the emulated kernels), also tiled, sliced, non-causal (and modulated) and in fp32; unpatch
and state dicts, hooks on a paired norm, a replaced ``PerChannelRMSNorm.forward``; the norm -> SiLU -> convolution
chains (`ltx_norm_conv`, models/vae_ltx2_chain.py): the statements joined, one site per joined convolution, their
refusals exact (hooks, a dropout in training mode or replaced, a kernel one bit off); ``conv1``'s result handed to
``norm2``'s chain without its bias (`ltx_bias_norm_conv`): the rewrite, its sites, the decode reaching it, its
refusals; ``conv2``'s result handed to the resnet's residual add (`conv_bias_residual`): the rewrite (the add a
receiver, the operands' order kept), the site on each resnet, the third decode reaching it, its refusals (a residual
the kernel does not take, a shortcut resnet's, a kernel one bit off or failing). The norm op's own tests are in
test_per_channel_rmsnorm.py, the bias chain's kernel in test_ltx_bias_norm_conv.py, the residual add's in
test_conv_bias_residual.py; the full-size decode and the chain op at the decoder's shapes on the GPU at the end."""

from __future__ import annotations

import hashlib
import importlib
from collections import Counter

import pytest
import torch
from diffusers import AutoencoderKLLTX2Video
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoResnetBlock3d, PerChannelRMSNorm

import diffusers_fastpath as fp
from diffusers_fastpath.bench.levels.vae import VAE_MODELS
from diffusers_fastpath.models import vae_ltx, vae_ltx2, vae_ltx2_chain
from diffusers_fastpath.models.vae_ltx2_norm import FastpathPerChannelRMSNorm
from diffusers_fastpath.ops.causal_conv_cl import PendingBias
from diffusers_fastpath.testing._common import randomize_
from diffusers_fastpath.testing.checks import ltx_vae_sites, state_dict_round_trip

norm_conv = importlib.import_module("diffusers_fastpath.ops.ltx_norm_conv")  # (the package binds the op's name)
_TINY = VAE_MODELS["ltx2-tiny"][1]  # (the bench's: the published structure and compression, 8 channels)
CONFIGS = {"published": _TINY, "conditioned": {**_TINY, "timestep_conditioning": True, "decoder_causal": False}}


def _build(kind: str = "published", dtype=torch.bfloat16, seed=0):
    """A tiny VAE with random weights (every convolution and the timestep tables drawn: `randomize_`)."""
    return randomize_(AutoencoderKLLTX2Video(**CONFIGS[kind]), seed).to(dtype).eval()


def _patched_after_eager():
    """A tiny VAE, its latents and their eager decode, then the VAE patched: (vae, z, ref)."""
    vae = _build()
    z = _latents(vae)
    ref = _decode(vae, z)
    fp.patch(vae)
    return vae, z, ref


def _latents(vae, frames=2, size=2, seed=3, batch=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.latent_channels, frames, size, size, generator=gen).to(dtype)


def _video(frames=9, size=64, seed=4, batch=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, frames, size, size, generator=gen) * 2 - 1).to(dtype)


def _decode(vae, z, causal=None):
    temb = torch.tensor([0.05] * z.shape[0]) if vae.config.timestep_conditioning else None
    return vae.decode(z, temb, causal=causal).sample


def _encode(vae, x):
    return vae.encode(x).latent_dist.mean


def _norms(vae) -> int:
    return sum(type(m) is PerChannelRMSNorm for m in vae.modules())


def _chain_calls(report) -> dict:
    """Per joined convolution, (fast, fallback) of its two chain ops together (`ltx_norm_conv` on a tensor,
    `ltx_bias_norm_conv` on the previous convolution's pending result): each call is counted on one of them."""
    calls: dict = {}
    for r in report.sites:
        if r.op in ("ltx_norm_conv", "ltx_bias_norm_conv"):
            fast, fallback = calls.get(r.site.split(":")[0], (0, 0))
            calls[r.site.split(":")[0]] = (fast + r.fast, fallback + r.fallback)
    return calls


def _bias_sites(report) -> dict:
    return {r.site.split(":")[0]: r for r in report.sites if r.op == "ltx_bias_norm_conv"}


def _residual_sites(report) -> dict:
    """Per resnet (the block's path), its residual add's `conv_bias_residual` site."""
    return {r.site.split(":")[0]: r for r in report.sites if r.op == "conv_bias_residual"}


@torch.no_grad()
def test_patched_vae_decode_and_encode_equal_unpatched_every_site_fast(emulated_kernels, unpatch_after):
    """Every norm of the published form is paired with its SiLU (the resnets' two, each ``norm_out``); the encoder's
    zero-padded convolutions take `conv_bias`. (The non-causal decoder: the conditioned config's, below; a
    ``causal=False`` argument does not reach it, ``causal or self.is_causal``.)"""
    vae = _build()
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    assert torch.isfinite(ref_dec).all() and ref_dec.float().std() > 0.01 and ref_enc.float().std() > 0.01
    norms = _norms(vae)
    assert norms == 2 * sum(type(m) is LTX2VideoResnetBlock3d for m in vae.modules()) + 2
    convs = sum(type(m).__name__ == "LTX2VideoCausalConv3d" for m in vae.modules())
    unpatch_after(fp.patch(vae))
    ops = Counter(r.op for r in fp.report(vae).sites)
    assert ops["per_channel_rmsnorm_silu"] == norms and ops["ltx_causal_conv3d"] == convs and ops["conv_bias"], ops
    assert ops["ltx_norm_conv"] == norms, ops  # (every norm's pair is joined with the convolution after it)
    assert ops["ltx_bias_norm_conv"] == (norms - 2) // 2, ops  # (each resnet's conv2 receives conv1's result)
    assert ops["conv_bias_residual"] == (norms - 2) // 2, ops  # (each resnet's add receives conv2's result)
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert all(r.fast > 0 and r.fallback == 0 for r in ltx_vae_sites(fp.report(vae))), str(fp.report(vae))
    chains = _chain_calls(fp.report(vae))
    assert len(chains) == norms and set(chains.values()) == {(1, 0)}, str(fp.report(vae))
    # every convolution signature checked by now: each conv1 of whole 16-byte vectors of channels leaves its result
    # pending, and its conv2 takes it (the tiny VAE's 4-channel resnets: the tensor, as before)
    before = {path: r.fast for path, r in _bias_sites(fp.report(vae)).items()}
    assert torch.equal(_decode(vae, z), ref_dec)
    bias = _bias_sites(fp.report(vae))
    for path, r in bias.items():
        conv = vae.get_submodule(path)
        wide = conv.conv.in_channels % 8 == 0
        assert r.fallback == 0 and r.fast - before[path] == (wide and path.startswith("decoder.")), (path, str(r))
    assert any(r.fast for r in bias.values()) and any(not r.fast for r in bias.values())
    assert set(_chain_calls(fp.report(vae)).values()) <= {(1, 0), (2, 0)}, str(fp.report(vae))
    # and the third: conv2's chain, given conv1's pending result, checked by now too, leaves its own result pending
    # where its channels make whole 16-byte vectors, and the residual add takes it (one kernel pass, no fallback)
    before = {path: r.fast for path, r in _residual_sites(fp.report(vae)).items()}
    assert torch.equal(_decode(vae, z), ref_dec)
    residual = _residual_sites(fp.report(vae))
    assert set(residual) == {path.rsplit(".", 1)[0] for path in bias}
    for path, r in residual.items():
        wide = vae.get_submodule(path).conv2.conv.out_channels % 8 == 0
        assert r.fallback == 0 and r.fast - before[path] == (wide and path.startswith("decoder.")), (path, str(r))
    assert any(r.fast for r in residual.values()) and any(not r.fast for r in residual.values())


@torch.no_grad()
def test_a_timestep_conditioned_decoder_runs_its_modulate_between_norm_and_silu(emulated_kernels, unpatch_after):
    """With ``timestep_conditioning`` the resnets modulate between the norm and the SiLU: those run as written (the
    rewritten forward's other branch), the rest fused; patched == unpatched."""
    vae = _build("conditioned")
    z, x = _latents(vae), _video()
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)
    decoder_resnets = [r for r in report.sites if r.site.startswith("decoder.") and ".resnets." in r.site
                       and r.op == "per_channel_rmsnorm_silu"]
    assert decoder_resnets and all(r.fast == 0 and r.fallback == 0 for r in decoder_resnets), str(report)
    assert all(r.fallback == 0 for r in report.sites) and any(r.fast for r in report.sites), str(report)


@torch.no_grad()
def test_tiled_and_sliced_decode_and_encode_equal_unpatched(emulated_kernels, unpatch_after):
    vae = _build()
    # (tiles of two latents without overlap: a one-latent tile is narrower than the decoder's reflection padding,
    # which eager refuses too)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)
    vae.enable_slicing()
    z, x = _latents(vae, size=4, batch=2), _video(size=128, batch=2)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    assert all(r.fast > 0 and r.fallback == 0 for r in ltx_vae_sites(fp.report(vae))), str(fp.report(vae))
    assert all(fast > 1 and not fallback for fast, fallback in _chain_calls(fp.report(vae)).values())
    assert any(r.fast for r in _bias_sites(fp.report(vae)).values()), str(fp.report(vae))  # (the tiles' conv2s)


@torch.no_grad()
def test_fp32_vae_patched_equal_unpatched(emulated_kernels, unpatch_after):
    vae = _build(dtype=torch.float32)
    z, x = _latents(vae, dtype=torch.float32), _video(dtype=torch.float32)
    ref_dec, ref_enc = _decode(vae, z), _encode(vae, x)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode(vae, z), ref_dec)
    assert torch.equal(_encode(vae, x), ref_enc)
    report = fp.report(vae)
    assert all(r.fast > 0 for r in report.sites if r.op == "per_channel_rmsnorm_silu"), str(report)
    assert torch.equal(_decode(vae, z), ref_dec)
    # (fp32 convolutions run channels-first: no result is left pending, the receivers get tensors)
    assert all(r.fast == r.fallback == 0 for r in _bias_sites(fp.report(vae)).values()), str(fp.report(vae))


def test_unpatch_restores_classes_and_state_dict():
    vae = _build()
    with state_dict_round_trip(vae):
        assert type(vae.decoder.up_blocks[0].resnets[0]).__name__ == "FastpathLTX2VideoResnetBlock3d"
        assert type(vae.decoder) is vae_ltx2.BLOCKS[2].sub
    assert type(vae.decoder.up_blocks[0].resnets[0]) is LTX2VideoResnetBlock3d
    assert all(type(m).__module__.startswith("diffusers.") or type(m).__module__.startswith("torch.")
               for m in vae.modules())
    assert not any(k.startswith("_fastpath") for m in vae.modules() for k in m.__dict__)


@torch.no_grad()
def test_a_hooked_paired_norm_runs_its_modules_with_their_hooks(emulated_kernels, unpatch_after):
    """A forward hook on a paired norm: that pair runs the norm and the SiLU as two module calls (the hook sees the
    norm's output), counted "hooks"; every other pair stays fast."""
    vae = _build()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    norm = vae.decoder.mid_block.resnets[0].norm1
    seen = []
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert len(seen) == 1
    site = norm._fastpath_site_per_channel_rmsnorm_silu
    assert (site.fast, dict(site.fallback)) == (0, {"hooks": 1})


def test_a_replaced_norm_forward_is_left_unpatched(monkeypatch, emulated_kernels, fastpath_log):
    """Another library replaced ``PerChannelRMSNorm.forward``: not provably the checked code, so the norms get no
    site and keep their class (one warning); the replacement runs; the convolutions are still patched."""
    calls = []
    original = PerChannelRMSNorm.forward

    def replaced(self, x, channel_dim=None):
        calls.append(1)
        return original(self, x, channel_dim)

    monkeypatch.setattr(PerChannelRMSNorm, "forward", replaced)
    vae = _build()
    z = _latents(vae)
    with torch.no_grad():
        ref = _decode(vae, z)
        eager_calls = len(calls)
        fp.patch(vae)
        try:
            assert torch.equal(_decode(vae, z), ref)
            assert len(calls) == 2 * eager_calls > 0
            assert {r.op for r in fp.report(vae).sites} == {"conv_bias", "ltx_causal_conv3d", "ltx_upsampler3d"}
            assert type(vae.decoder.norm_out) is PerChannelRMSNorm
        finally:
            fp.unpatch(vae)
    assert "PerChannelRMSNorm.forward is not the form" in fastpath_log.text


# --- the norm -> SiLU -> convolution chains -------------------------------------------------------------------------


def test_the_resnet_and_decoder_forwards_join_each_pair_with_its_convolution():
    """The rewritten forwards: the resnet's two pairs joined with ``conv1`` and (past the identity ``dropout``)
    ``conv2``, each on the branch without the timestep modulate; ``norm_out -> conv_act`` with ``conv_out``; the
    modulated branches keep the statements as written."""
    resnet, encoder, decoder = (block.current() for block in vae_ltx2.BLOCKS)
    assert vae_ltx2_chain._joined_convs(resnet.forward) == ("conv1", "conv2")
    assert vae_ltx2_chain._joined_convs(encoder.forward) == ("conv_out",)
    assert vae_ltx2_chain._joined_convs(decoder.forward) == ("conv_out",)
    import inspect

    source = inspect.getsource(resnet.forward)
    assert "norm_act_conv_pending(self, 'norm2', 'nonlinearity', ('dropout',), 'conv2', hidden_states, causal=causal)" \
        in source
    assert source.count("self.conv1(hidden_states, causal=causal)") == 1  # (the modulated branch's, as written)


def test_the_resnet_forward_hands_conv1s_result_to_conv2s_chain():
    """The rewritten resnet forward: ``conv1``'s joined call may leave its result pending; the noise injection's
    branch and the modulated branch (which read it otherwise) settle it first; ``conv2``'s joined call, the other
    branch's first statement, takes it and may leave its own result pending in turn; the second noise injection's
    branch settles that, the shortcut's statements (which do not read it) stay as they are, and the residual add
    takes it (``pending_add``, the operands in their order). The encoder's and decoder's ``conv_out`` (read by the
    patchifying reshape) stay plain joined calls."""
    import inspect

    resnet, encoder, decoder = (block.current() for block in vae_ltx2.BLOCKS)
    source = inspect.getsource(resnet.forward)
    ns = "_diffusers_fastpath_vae_ltx2"
    assert source.count(f"hidden_states = {ns}.norm_act_conv_pending(self, 'norm1', 'nonlinearity', (), 'conv1', "
                        "hidden_states, causal=causal)") == 1
    assert source.count(f"hidden_states = {ns}.pending_norm_act_conv_pending(self, 'norm2', 'nonlinearity', "
                        "('dropout',), 'conv2', hidden_states, causal=causal)") == 1
    assert source.count(f"hidden_states = {ns}.settled(hidden_states)") == 3
    lines = [line.strip() for line in source.splitlines()]
    settles = [i for i, line in enumerate(lines) if line.endswith(".settled(hidden_states)")]
    assert [lines[i - 1] for i in settles] == ["if self.per_channel_scale1 is not None:",
                                               "if self.scale_shift_table is not None:",
                                               "if self.per_channel_scale2 is not None:"]
    assert lines[-2:] == [f"hidden_states = {ns}.pending_add(self, hidden_states, inputs)", "return hidden_states"]
    assert "inputs = self.conv_shortcut(inputs)" in lines and "hidden_states + inputs" not in source
    assert vae_ltx2_chain._joined_convs(resnet.forward, (vae_ltx2_chain.RECEIVER,)) == ()
    assert vae_ltx2_chain._joined_convs(resnet.forward, (vae_ltx2_chain.RECEIVER_PENDING,)) == ("conv2",)
    assert vae_ltx2_chain._adds(resnet.forward) == 1
    for block in (encoder, decoder):
        text = inspect.getsource(block.forward)
        assert "pending" not in text and "settled" not in text


def _pending_rewrite(code: str, joined: bool = True, adds: bool = True) -> str:
    """`vae_ltx2_chain._Pending` on the statements of `code` (joined calls written as `_Chains` makes them), making
    the receivers asked for."""
    import ast
    import textwrap

    body = ast.parse(textwrap.dedent(code)).body
    rewritten = vae_ltx2_chain._Pending("ns", body, joined, adds).body(body)
    return ast.unparse(ast.fix_missing_locations(ast.Module(rewritten, [])))


_J1 = "x = ns.norm_act_conv(self, 'n1', 'a', (), 'c1', x, causal=c)"
_J2 = "x = ns.norm_act_conv(self, 'n2', 'a', ('d',), 'c2', x, causal=c)"


def test_the_pending_rewrite_settles_every_other_reader_and_defers_nothing_it_cannot_prove():
    """`_Pending`: the first call leaves its value pending only where every path from it reaches the receiving call or
    a settle before anything else reads the value; nothing changes where no receiver is reached that way, or where the
    value could be read by other code (a closure, ``locals()``), or inside a loop."""
    pending, receiver = "ns.norm_act_conv_pending(", "ns.pending_norm_act_conv("
    # straight line, a statement that does not name x between: joined
    out = _pending_rewrite(f"{_J1}\ny = 3\n{_J2}\nreturn x")
    assert out.count(pending) == 1 and out.count(receiver) == 1 and "settled" not in out
    # an if without else that reads x (settled in it), then the receiver
    out = _pending_rewrite(f"{_J1}\nif self.a is not None:\n    x = x * 2\n{_J2}")
    assert out.splitlines()[1:3] == ["if self.a is not None:", "    x = ns.settled(x)"] and out.count(receiver) == 1
    # the receiver on one branch; the other, an elif chain that reads x, settles first
    out = _pending_rewrite(f"{_J1}\nif t:\n    {_J2}\nelif u:\n    x = f(x)\nelse:\n    y = 1\nreturn x")
    assert out.count(receiver) == 1 and out.count("x = ns.settled(x)") == 1, out
    assert out.splitlines()[3:5] == ["else:", "    x = ns.settled(x)"], out
    # a branch that does not name x leaves it pending past the if: settled before the next reader
    out = _pending_rewrite(f"{_J1}\nif t:\n    {_J2}\nelse:\n    y = 1\nreturn x")
    assert out.count(receiver) == 1 and out.splitlines()[-2:] == ["x = ns.settled(x)", "return x"], out
    out = _pending_rewrite(f"if m:\n    {_J1}\n    if t:\n        {_J2}\nelse:\n    x = 2\nz = x")
    assert out.count(receiver) == 1 and out.count("settled") == 1 and out.splitlines()[-1] == "z = x", out
    # an if whose first branch ends in the joined call, every branch binding x (LTX-2's resnet form)
    out = _pending_rewrite(f"if m:\n    x = self.c1(x)\nelse:\n    {_J1}\nif m:\n    x = g(x)\nelse:\n    {_J2}")
    assert out.count(pending) == 1 and out.count(receiver) == 1 and out.count("settled") == 1
    # not joined: a reader before the receiver, a test that reads x, a branch that does not bind x, no receiver
    for code in (f"{_J1}\ny = x\n{_J2}", f"{_J1}\nif x.any():\n    pass\n{_J2}", f"{_J1}\nreturn x",
                 f"if m:\n    y = 1\nelse:\n    {_J1}\n{_J2}"):
        out = _pending_rewrite(code)
        assert pending not in out and receiver not in out and "settled" not in out, (code, out)
    # not joined: the value reachable by other code, or in a loop's body
    for code in (f"f = lambda: x\n{_J1}\n{_J2}", f"{_J1}\nv = locals()\n{_J2}",
                 f"{_J1}\nv = sys._getframe()\n{_J2}", f"for i in r:\n    {_J1}\n    {_J2}",
                 f"{_J1}\nys = [x for _ in r]\n{_J2}", f"global x\n{_J1}\n{_J2}"):
        out = _pending_rewrite(code)
        assert pending not in out and receiver not in out, (code, out)


def test_the_pending_rewrite_hands_a_value_to_the_residual_add_after_it():
    """`_Pending` with the residual add ``V = V + E`` / ``V = E + V`` (E not naming V) as a receiver: it becomes
    ``V = ns.pending_add(self, <left>, <right>)``, the operands in their order; a joined call that receives and is
    followed by such an add leaves its own value pending too (``pending_norm_act_conv_pending``); any other add (of V
    to itself, of an E that reads V, an in-place ``+=``, another operator, another target) is a reader that settles."""
    add, both = "ns.pending_add(self, ", "ns.pending_norm_act_conv_pending("
    # conv1 -> conv2 -> add, statements between that do not name x (the resnet's shortcut)
    out = _pending_rewrite(f"{_J1}\n{_J2}\nif s:\n    r = self.sc(r)\nx = x + r\nreturn x")
    assert out.count("ns.norm_act_conv_pending(") == 1 and out.count(both) == 1 and "settled" not in out, out
    assert out.splitlines()[-2:] == ["x = ns.pending_add(self, x, r)", "return x"], out
    # the residual on the left: its order kept
    out = _pending_rewrite(f"{_J1}\nx = self.r + x")
    assert out.splitlines() == [_J1.replace("norm_act_conv(", "norm_act_conv_pending("),
                                "x = ns.pending_add(self, self.r, x)"], out
    # an if whose branch reads x first: settled there; the add after it receives what the other path left pending
    out = _pending_rewrite(f"{_J1}\n{_J2}\nif n:\n    x = x * 2\nx = x + r")
    assert out.count(both) == 1 and out.count("x = ns.settled(x)") == 1 and out.count(add) == 1, out
    # an add at a branch's start receives; the other branch settles
    out = _pending_rewrite(f"{_J1}\nif n:\n    x = x + r\nelse:\n    x = g(x)\nreturn x")
    assert out.count(add) == 1 and out.count("x = ns.settled(x)") == 1, out
    # not an add that receives: each is a reader, so nothing is left pending
    for code in ("x = x + x", "x = x + f(x)", "x += r", "x = x - r", "y = x + r", "x = x + r + s", "x = (x, r)"):
        out = _pending_rewrite(f"{_J1}\n{code}")
        assert "pending" not in out and "settled" not in out, (code, out)


def test_the_pending_rewrite_makes_only_the_receivers_its_calls_have_an_op_for():
    """`_Pending` for a `ChainPairCalls` without a bias op (``joined`` False: a joined call is a reader, settled
    before) or without a residual op (``adds`` False: the add is a reader, as written); LTX-2's has both (the
    resnet's ``conv1 -> conv2 -> add``), LTX-Video's neither (`_Pending` not run)."""
    code = f"{_J1}\n{_J2}\nx = x + r\nreturn x"
    assert _pending_rewrite(code, joined=False).splitlines() == [
        _J1, _J2.replace("norm_act_conv(", "norm_act_conv_pending("), "x = ns.pending_add(self, x, r)", "return x"]
    assert _pending_rewrite(code, adds=False).splitlines() == [
        _J1.replace("norm_act_conv(", "norm_act_conv_pending("), _J2.replace("norm_act_conv(", "pending_norm_act_conv("),
        "x = x + r", "return x"]
    ltx2, ltxv = vae_ltx2.PAIRS, vae_ltx.PAIRS
    assert (ltx2.bias.name, ltx2.residual.name) == ("ltx_bias_norm_conv", "conv_bias_residual")
    assert ltxv.bias is None and ltxv.residual is None


def test_a_convolution_keyword_read_from_the_chained_value_is_not_joined():
    """The joined call evaluates the convolution's keywords before the norm, SiLU and dropout run: a keyword that
    reads V (or is any other expression) must keep its statement, a constant or another name may move."""
    import ast

    def convs(keyword):
        tree = ast.parse(f"hidden_states = self.conv1(hidden_states, causal={keyword})")
        return vae_ltx2_chain._self_call(tree.body[0], ("causal",))

    assert convs("causal") is not None and convs("True") is not None
    assert convs("hidden_states") is None
    assert convs("bool(hidden_states.mean() > 0)") is None


def _chain_site(vae, conv):
    return conv.__dict__[f"_fastpath_site_{norm_conv.LTX_NORM_CONV.name}"]


@torch.no_grad()
def test_chain_refusals_run_the_statements_as_written(emulated_kernels, unpatch_after):
    """A hook on a joined convolution (it sees the SiLU's result), a dropout in training mode, a dropout replaced by
    another module: that chain runs the pair, the module between and the convolution's call, counted with the
    reason; patched == unpatched; the other chains stay fast."""
    vae = _build()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    resnet = vae.decoder.mid_block.resnets[0]
    seen = []
    handle = resnet.conv1.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape),
                                                    with_kwargs=True)
    resnet.dropout.train()
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
        resnet.dropout.eval()
    assert len(seen) == 1
    assert dict(_chain_site(vae, resnet.conv1).fallback) == {"FastpathLTX2VideoCausalConv3d has hooks": 1}
    assert dict(_chain_site(vae, resnet.conv2).fallback) == {"dropout in training mode": 1}
    assert resnet.norm1._fastpath_site_per_channel_rmsnorm_silu.fast == 1  # (the pair's own site, as written)
    dropout = resnet.dropout
    resnet.dropout = torch.nn.Identity()
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        resnet.dropout = dropout
    assert _chain_site(vae, resnet.conv2).fallback["Identity between the SiLU and the convolution"] == 1
    others = [calls for path, calls in _chain_calls(fp.report(vae)).items() if path.startswith("decoder.")
              and ".mid_block.resnets.0." not in path]
    assert others and set(others) == {(2, 0)}, str(fp.report(vae))


def _one_value_off(launch):
    """`launch` (a padded channels-last buffer's) with one value of its result off: its exponent, the value x 4."""
    def off(*args):
        out = launch(*args)
        out.view(torch.int16).permute(0, 2, 3, 4, 1).reshape(-1)[5] += 0x100
        return out
    return off


@torch.no_grad()
def test_a_pad_kernel_that_differs_is_caught_on_its_first_call(monkeypatch, emulated_kernels, fastpath_log):
    """One value of the pad kernel's buffer off: the first call of the signature compares with eager, returns eager's result
    and disables the op (one warning); the decode is still unpatched's, through the pairs and convolutions."""
    monkeypatch.setattr(norm_conv, "_launch", _one_value_off(norm_conv._launch))
    monkeypatch.setattr(norm_conv.LTX_NORM_CONV, "disabled", None)
    monkeypatch.setattr(norm_conv.LTX_NORM_CONV, "verified", set())
    vae, z, ref = _patched_after_eager()
    try:
        assert torch.equal(_decode(vae, z), ref)
        assert "not bit-exact" in norm_conv.LTX_NORM_CONV.disabled
        chains = [r for r in fp.report(vae).sites if r.op == "ltx_norm_conv"]
        assert chains and all(r.fast == 0 for r in chains)
        # (every chain ran its statements as written, the checked one too: the pairs' own sites)
        pairs = [r for r in fp.report(vae).sites if r.op == "per_channel_rmsnorm_silu" and r.site[:8] == "decoder."]
        assert pairs and all(r.fast == 1 for r in pairs), str(fp.report(vae))
    finally:
        fp.unpatch(vae)
    assert sum("disabling the fused op 'ltx_norm_conv'" in r.getMessage() for r in fastpath_log.records) == 1


def _decode_twice(vae, z):
    """Decode twice (the first call of each convolution signature checks it and returns the tensor; the second
    leaves results pending), the second's output."""
    _decode(vae, z)
    return _decode(vae, z)


@torch.no_grad()
def test_a_decoder_that_injects_noise_settles_conv1s_result_for_it(emulated_kernels, unpatch_after):
    """``decoder_inject_noise``: the resnets with ``per_channel_scale1`` add noise to ``conv1``'s result, so the
    rewritten forward's settle runs there and ``conv2``'s chain gets the tensor (its bias site idle); the others
    still hand it on; patched == unpatched (the noise drawn from the same seed)."""
    vae = randomize_(AutoencoderKLLTX2Video(**{**_TINY, "decoder_inject_noise": (False, True, False, False)}), 0)
    vae = vae.to(torch.bfloat16).eval()
    z = _latents(vae)

    def decode():
        torch.manual_seed(7)
        return _decode(vae, z)

    ref = decode()
    unpatch_after(fp.patch(vae))
    assert torch.equal(decode(), ref) and torch.equal(decode(), ref)
    bias = _bias_sites(fp.report(vae))
    noisy = {path for path in bias if vae.get_submodule(path.rsplit(".", 1)[0]).per_channel_scale1 is not None}
    assert noisy and all(bias[path].fast == bias[path].fallback == 0 for path in noisy), str(fp.report(vae))
    assert any(r.fast for path, r in bias.items() if path not in noisy), str(fp.report(vae))
    # (``per_channel_scale2``'s noise reads conv2's result too: settled there, the residual add gets a tensor)
    assert torch.equal(decode(), ref)
    residual = _residual_sites(fp.report(vae))
    noisy = {path for path in residual if vae.get_submodule(path).per_channel_scale2 is not None}
    assert noisy and all(residual[path].fast == residual[path].fallback == 0 for path in noisy), str(fp.report(vae))
    assert any(r.fast for path, r in residual.items() if path not in noisy), str(fp.report(vae))


@torch.no_grad()
def test_bias_chain_refusals_settle_and_run_the_chain_as_before(emulated_kernels, unpatch_after):
    """Given ``conv1``'s pending result, a hook on ``conv2`` (it sees the SiLU's result) or a dropout in training
    mode refuse `ltx_bias_norm_conv` (counted on its site); the value is settled and ``conv2``'s chain runs as before
    (refused too: the statements as written, the hook run); patched == unpatched; a hook on ``conv1`` leaves its
    result a tensor (nothing counted on the bias site)."""
    vae = _build()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    _decode(vae, z)  # (every signature checked)
    resnet = vae.decoder.up_blocks[0].resnets[0]
    site = _bias_sites(fp.report(vae))["decoder.up_blocks.0.resnets.0.conv2"]
    assert resnet.conv1.conv.out_channels % 8 == 0 and site.fast == 0
    seen = []
    handle = resnet.conv2.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape),
                                                    with_kwargs=True)
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert len(seen) == 1
    bias_site = resnet.conv2._fastpath_site_ltx_bias_norm_conv
    assert dict(bias_site.fallback) == {"FastpathLTX2VideoCausalConv3d has hooks": 1} and bias_site.fast == 0
    assert dict(_chain_site(vae, resnet.conv2).fallback) == {"FastpathLTX2VideoCausalConv3d has hooks": 1}
    resnet.dropout.train()
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        resnet.dropout.eval()
    assert bias_site.fallback["dropout in training mode"] == 1
    handle = resnet.conv1.register_forward_hook(lambda *args: None)
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert (bias_site.fast, bias_site.fallback.total()) == (0, 2)
    assert torch.equal(_decode(vae, z), ref)
    assert bias_site.fast == 1


@torch.no_grad()
def test_a_bias_chain_kernel_that_differs_is_caught_on_its_first_call(monkeypatch, emulated_kernels, fastpath_log):
    """One value of the channels-last kernel's buffer off: the first call of its signature compares with eager,
    returns eager's result and disables the op (one warning); the decode is still unpatched's, the pending results
    settled and run through `ltx_norm_conv`."""
    bias_conv = importlib.import_module("diffusers_fastpath.ops.ltx_bias_norm_conv")
    monkeypatch.setattr(bias_conv, "_launch", _one_value_off(bias_conv._launch))
    vae, z, ref = _patched_after_eager()
    try:
        assert torch.equal(_decode_twice(vae, z), ref) and torch.equal(_decode(vae, z), ref)
        assert "not bit-exact" in bias_conv.LTX_BIAS_NORM_CONV.disabled
        assert all(r.fast == 0 for r in _bias_sites(fp.report(vae)).values())
        decoder = [r for r in fp.report(vae).sites if r.op == "ltx_norm_conv" and r.site.startswith("decoder.")]
        assert decoder and all(r.fast == 3 and r.fallback == 0 for r in decoder), str(fp.report(vae))
    finally:
        fp.unpatch(vae)
    assert sum("disabling the fused op 'ltx_bias_norm_conv'" in r.getMessage() for r in fastpath_log.records) == 1


@torch.no_grad()
def test_the_guard_refuses_what_the_pad_kernel_does_not_take():
    """fp32 (the convolution's channels-first path), an activation other than nn.SiLU, a causal that is no bool, a
    CPU tensor (aten's mean has no order to reproduce there): refused with the reason, never raised."""
    vae = _build()
    fp.patch(vae)
    try:
        resnet = vae.decoder.mid_block.resnets[0]
        x = torch.randn(1, resnet.conv1.in_channels, 3, 4, 4, dtype=torch.bfloat16)
        guard = norm_conv.LTX_NORM_CONV.guard
        assert guard(resnet.norm1, torch.nn.GELU(), resnet.conv1, x, False) == "GELU is not nn.SiLU"
        assert guard(resnet.norm1, resnet.nonlinearity, resnet.conv1, x, 1) == "causal not a bool"
        assert guard(resnet.norm1, resnet.nonlinearity, resnet.conv1, x, False).startswith("aten's mean")
        vae.float()
        assert guard(resnet.norm1, resnet.nonlinearity, resnet.conv1, x.float(),
                     False) == "the convolution's channels-first path"
    finally:
        fp.unpatch(vae)


# --- the residual add reading conv2's result (`conv_bias_residual`) -------------------------------------------------


def _decode_thrice(vae, z):
    """Decode three times (the first checks each convolution signature, the second each chain's on conv1's pending
    result; the third leaves conv2's results pending for the residual adds), the third's output."""
    _decode(vae, z)
    return _decode_twice(vae, z)


@torch.no_grad()
def test_residual_add_refusals_settle_and_add_as_written(emulated_kernels, unpatch_after):
    """Given conv2's pending result, a residual the kernel does not take (here a block input laid out with H and W
    swapped, as a user's pre-hook hands it on: eager's add keeps its own layout rules) refuses `conv_bias_residual`,
    counted on the block's site; the value is settled and added as the statement is written, patched == unpatched. A
    hook on conv2 (its chain refused: the tensor) leaves nothing pending and counts nothing there; removed, the add is
    fast again."""
    vae = _build()
    z = _latents(vae)
    resnet = vae.decoder.mid_block.resnets[0]

    def strided(module, args, kwargs):
        x = args[0]
        return (x.transpose(3, 4).contiguous().transpose(3, 4), *args[1:]), kwargs

    handle = resnet.register_forward_pre_hook(strided, with_kwargs=True)
    try:
        ref_strided = _decode(vae, z)
    finally:
        handle.remove()
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode_thrice(vae, z), ref)
    site = resnet._fastpath_site_conv_bias_residual
    fast = site.fast
    assert fast >= 1 and site.fallback.total() == 0
    handle = resnet.register_forward_pre_hook(strided, with_kwargs=True)
    try:
        assert torch.equal(_decode(vae, z), ref_strided)
    finally:
        handle.remove()
    assert (site.fast, dict(site.fallback)) == (fast, {"residual not contiguous": 1}), str(site)
    handle = resnet.conv2.register_forward_hook(lambda *args: None)
    try:
        assert torch.equal(_decode(vae, z), ref)
    finally:
        handle.remove()
    assert (site.fast, site.fallback.total()) == (fast, 1)
    assert torch.equal(_decode(vae, z), ref)
    assert (site.fast, site.fallback.total()) == (fast + 1, 1)


@pytest.mark.parametrize("failure", ["one value off", "raises"])
@torch.no_grad()
def test_a_residual_kernel_that_differs_or_fails_falls_back_exactly(failure, monkeypatch, emulated_kernels,
                                                                   fastpath_log):
    """One value of the kernel's output off: the first call of its signature compares with eager, returns eager's
    result and disables the op (one warning); a kernel that raises: disabled on that call, eager's result, one
    warning. Either way the decode stays unpatched's, each later add settled and added as written (counted)."""
    conv_bias_module = importlib.import_module("diffusers_fastpath.ops.conv_bias")
    residual_op = importlib.import_module("diffusers_fastpath.ops.conv_bias_residual").CONV_BIAS_RESIDUAL
    launch = conv_bias_module._residual_op

    def off(raw, bias, residual):
        out = launch(raw, bias, residual)
        out.view(torch.int16).reshape(-1)[5] += 0x100  # (its exponent: the value x 4)
        return out

    def raises(raw, bias, residual):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(conv_bias_module, "_residual_op", off if failure == "one value off" else raises)
    vae, z, ref = _patched_after_eager()
    try:
        assert torch.equal(_decode_thrice(vae, z), ref) and torch.equal(_decode(vae, z), ref)
        assert ("not bit-exact" if failure == "one value off" else "launch failed") in residual_op.disabled
        residual = _residual_sites(fp.report(vae))
        assert all(r.fast == 0 for r in residual.values()), str(fp.report(vae))
        assert any(r.fallback for r in residual.values()), str(fp.report(vae))
    finally:
        fp.unpatch(vae)
    assert sum("disabling the fused op 'conv_bias_residual'" in r.getMessage() for r in fastpath_log.records) == 1


@torch.no_grad()
def test_a_shortcut_resnet_adds_its_shortcut_as_eager_does(emulated_kernels, unpatch_after):
    """Resnets whose channels change (``upsample_factor`` 1 makes the up blocks' ``conv_in`` ones) add ``inputs``
    after ``norm3`` (over the channels-last view) and ``conv_shortcut``: the shortcut's result is laid out
    channels-last, which the kernel does not take (eager's sum follows the contiguous left operand): refused with the
    reason, settled and added as written; patched == unpatched; the other resnets' adds fast."""
    vae = randomize_(AutoencoderKLLTX2Video(**{**_TINY, "upsample_factor": (1, 1, 1)}), 0).to(torch.bfloat16).eval()
    z = _latents(vae)
    ref = _decode(vae, z)
    unpatch_after(fp.patch(vae))
    assert torch.equal(_decode_thrice(vae, z), ref)
    residual = _residual_sites(fp.report(vae))
    shortcut = {path for path in residual if vae.get_submodule(path).conv_shortcut is not None}
    assert shortcut and all(set(residual[path].reasons) == {"residual not contiguous"} for path in shortcut
                            if residual[path].fallback), str(fp.report(vae))
    assert any(residual[path].fallback for path in shortcut), str(fp.report(vae))
    assert any(r.fast for path, r in residual.items() if path not in shortcut), str(fp.report(vae))


def test_pending_add_keeps_the_operands_order_and_settles_where_not_taken():
    """`ChainPairCalls.pending_add` without the block's site (a block of another patch) or with operands the kernel
    does not take: the pending operand settled (bias_contiguous's tensor: on a CPU aten's add and copy) and the
    statement's add, in its order (a tensor subclass's ``__add__`` or ``__radd__`` is still the one called); with
    neither operand pending, the add as written."""
    owner = torch.nn.Module()
    raw = torch.randn(1, 8, 2, 3, 4).to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    bias = torch.randn(8).to(torch.bfloat16)
    h = (raw + bias.view(1, -1, 1, 1, 1)).contiguous()  # (eager's convolution result)
    res = torch.randn(1, 8, 2, 3, 4).to(torch.bfloat16)
    add = vae_ltx2.PAIRS.pending_add
    for left, right, want in ((PendingBias(raw, bias), res, h + res), (res, PendingBias(raw, bias), res + h),
                              (h, res, h + res), (PendingBias(raw, bias), 1, h + 1)):
        out = add(owner, left, right)
        assert out.is_contiguous() and torch.equal(out, want)
    calls = []

    class Logged(torch.Tensor):
        def __radd__(self, other):
            calls.append("radd")
            return torch.Tensor.__radd__(self, other)

    out = add(owner, PendingBias(raw, bias), res.as_subclass(Logged))
    assert calls == ["radd"] and torch.equal(out.as_subclass(torch.Tensor), h + res)


# --- GPU: the full-size LTX-2 VAE ----------------------------------------------------------------------------------


def _md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.float().cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
@pytest.mark.full_size
@torch.no_grad()
def test_ltx2_vae_decode_md5_identical_every_site_fast(unpatch_after):
    """The published VAE (random bf16 weights) decoding 768x512x121 (latents 16 x 16 x 24): md5-identical with every
    site fast, no fallback."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cls, config = VAE_MODELS["ltx2"]
    vae = randomize_(AutoencoderKLLTX2Video(**config), 0).to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 128, 16, 16, 24, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    ref = _md5(vae.decode(z).sample)
    unpatch_after(fp.patch(vae))
    assert _md5(vae.decode(z).sample) == ref
    report = fp.report(vae)
    assert all(r.fallback == 0 for r in report.sites) and sum(r.fast for r in report.sites) > 0, str(report)



# The chain at the LTX-2 decoder's shapes (768x512x121, latents [1, 128, 16, 16, 24]: the mid block at 1024 channels,
# the up blocks at 512, 256, 128 and norm_out -> conv_out 128 -> 48), reflected and non-causal as the decoder runs it;
# and the encoder's form (zero spatial padding, causal) at two of its shapes.
CHAIN_SHAPES = [((1, 1024, 16, 16, 24), 1024, "reflect", False), ((1, 512, 31, 32, 48), 512, "reflect", False),
                ((1, 256, 61, 64, 96), 256, "reflect", False), ((1, 128, 121, 128, 192), 48, "reflect", False),
                ((1, 256, 61, 64, 96), 256, "zeros", True), ((1, 1024, 16, 16, 24), 1024, "zeros", True)]


# Odd geometry: one frame (the first frame is the last), rows and columns of 2 (each reflected copy at both ends),
# channels not a multiple of the staging chunk, widths of no vector, two batches; and x with its first frame sliced
# off (channels apart), as the upsamplers leave it.
ODD_CHAIN_SHAPES = [((1, 40, 1, 3, 5), 40, "reflect", False), ((2, 24, 3, 2, 7), 16, "reflect", False),
                    ((1, 72, 2, 2, 2), 8, "reflect", True), ((2, 24, 3, 5, 16), 24, "zeros", True),
                    ((1, 48, 5, 6, 8), 48, "reflect", False, "sliced")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ODD_CHAIN_SHAPES, ids=str)
@torch.no_grad()
def test_chain_equals_eager_at_odd_shapes(case, dtype):
    """The pad kernel's borders and tails: as `test_chain_equals_eager_at_ltx2_decoder_shapes`, at `ODD_CHAIN_SHAPES`."""
    test_chain_equals_eager_at_ltx2_decoder_shapes(*case[:4], dtype, *case[4:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,out_channels,mode,causal", CHAIN_SHAPES, ids=str)
@torch.no_grad()
def test_chain_equals_eager_at_ltx2_decoder_shapes(shape, out_channels, mode, causal, dtype, layout="contiguous"):
    """`ltx_norm_conv` (its pad kernel, proofs and first-call check included) against diffusers' modules called as
    the block calls them, bit for bit (`tensors_equal`: NaN included), the allocator's blocks poisoned with NaN first;
    fresh random inputs with all-zero positions and means near eps. In fp16 eager's own result is NaN around the
    all-zero positions: eps (1e-8) added in fp32 and rounded to fp16 is 0 (below half the least subnormal), so r = 0
    and 0 / 0 = NaN, which the convolution spreads to its neighbours (the inputs are far from overflow: |x| < 12, the
    fp32 chain's outputs below 3 at these scales); the kernel must give the same words there, and the rest is finite."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoCausalConv3d

    from diffusers_fastpath.models.vae_ltx2_norm import norm_fits
    from diffusers_fastpath.models.vae_ltx_conv import CONV_DIGESTS
    from diffusers_fastpath.models.vae import checked_forwards
    from diffusers_fastpath.ops.ltx_causal_conv import add_conv_class
    from diffusers_fastpath.ops import Site
    from diffusers_fastpath.ops._policy import tensors_equal

    norm_fits()
    checked_forwards([LTX2VideoCausalConv3d], CONV_DIGESTS, register=add_conv_class)
    gen = torch.Generator().manual_seed(sum(shape) + out_channels)
    conv = LTX2VideoCausalConv3d(shape[1], out_channels, 3, spatial_padding_mode=mode)
    conv = randomize_(conv, int(gen.initial_seed()) % 1000).to("cuda", dtype).eval()
    norm, act = PerChannelRMSNorm(), torch.nn.SiLU()
    full = (shape[0], shape[1], shape[2] + (layout == "sliced"), *shape[3:])
    x = (torch.randn(full, generator=gen) * 3).to("cuda", dtype)
    x = x[:, :, 1:] if layout == "sliced" else x
    if dtype is torch.bfloat16 or min(shape[3:]) > 2:  # (fp16: the NaN below would cover a 2x2 frame whole)
        x[:, :, 0, 0, :5] = 0  # (sqrt of eps)
    x[:, :, 0, 1, :7] *= 1e-4
    ref = conv(act(norm(x)), causal=causal)
    padded = shape[0] * shape[1] * (shape[2] + 2) * (shape[3] + 2) * (shape[4] + 2)
    torch.full((2 * padded,), float("nan"), dtype=dtype, device="cuda")  # (freed: the next blocks hold NaN)
    torch.cuda.synchronize()
    site = Site(norm_conv.LTX_NORM_CONV.name)
    out = norm_conv.LTX_NORM_CONV(site, norm, act, conv, x, causal)
    assert site.fast == 1, (dict(site.fallback), norm_conv.LTX_NORM_CONV.disabled)
    assert out.stride() == ref.stride() and tensors_equal(out, ref)  # (the same bits: a NaN that eager gives too)
    assert ref.isfinite().any()
