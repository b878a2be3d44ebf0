"""Shared fixtures. Models come from `diffusers_fastpath.testing` (published or tiny configs, random weights)."""

from __future__ import annotations

import logging

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath.ops import OPS


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_ops():
    """Every test starts with every op enabled (a test may disable one on purpose)."""
    for op in OPS.values():
        op.reset()
    yield
    for op in OPS.values():
        op.reset()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from an empty dynamo cache: many tests compile the same diffusers forwards, each with its
    own backend callable, and the ninth such compile in one process (one pytest-xdist worker) would hit dynamo's
    recompile limit, which under ``fullgraph=True`` raises ``FailOnRecompileLimitHit``, whatever that test checks."""
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _process_wide_state():
    """What one test may change for the whole process, put back: diffusers' active attention backend (which
    ``set_attention_backend`` sets process-wide) and the package's once-per-process warnings."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from diffusers_fastpath import _logging

    backend = _AttentionBackendRegistry._active_backend
    warned = set(_logging._warned)
    _logging._warned.clear()
    yield
    _AttentionBackendRegistry.set_active_backend(backend)
    _logging._warned.clear()
    _logging._warned.update(warned)


@pytest.fixture
def set_precision():
    """``set_precision(obj, value)`` sets torch's per-op ``obj.fp32_precision`` (torch >= 2.9: torch.backends.cudnn.conv,
    torch.backends.cuda.matmul, ...) for the test and puts back the value read before. Not pytest's monkeypatch: these
    are computed attributes, which newer pytest records as absent and then fails to undo, leaving every later patch of
    the same test (the emulated kernels) in place for the tests after it."""
    saved = []

    def set_(obj, value):
        saved.append((obj, obj.fp32_precision))
        obj.fp32_precision = value

    yield set_
    for obj, value in reversed(saved):
        obj.fp32_precision = value


@pytest.fixture
def unpatch_after():
    """Collects objects to unpatch at teardown, so a failing test leaves nothing patched."""
    objs = []
    yield objs.append
    for obj in objs:
        fp.unpatch(obj)


@pytest.fixture
def rope_launches(emulated_kernels, monkeypatch):
    """`ops.rmsnorm_rope`'s output launches (emulated on a CPU) recorded as ``(out.data_ptr(), out.shape)``: the
    list, to see which rows each launch wrote."""
    from diffusers_fastpath.ops import rmsnorm_rope as module

    launches = []
    emulated = module._launch_out

    def recording(out, *args):
        launches.append((out.data_ptr(), out.shape))
        emulated(out, *args)

    monkeypatch.setattr(module, "_launch_out", recording)
    return launches


@pytest.fixture
def source_module(tmp_path, monkeypatch):
    """``load(name, source)``: `source` written to a file and imported as the module `name`, registered in
    `sys.modules` for the test (the rewriter reads a class's source through its module's file, as diffusers')."""
    import importlib.util
    import sys

    def load(name: str, source: str):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def qwen21_cached_steps(unpatch_after):
    """``run(batch=1, device="cpu")``: the tiny Qwen-Image 2.1's extract and cached steps (`zoo.kv_cached_steps`) on
    fresh latents, unpatched, then patched (each step's first call of its signature also runs as written), the outputs
    asserted equal; returns the patched model, unpatched at teardown."""
    from diffusers_fastpath.testing import zoo

    def run(batch: int = 1, device: str = "cpu"):
        model = zoo.build("qwen-image-21", dtype=torch.bfloat16, device=device)
        kwargs = zoo.inputs("qwen-image-21", model, batch=batch)
        latents = [torch.randn_like(kwargs["hidden_states"]) for _ in range(2)]
        ref = zoo.kv_cached_steps(model, kwargs, latents)
        fp.patch(model)
        unpatch_after(model)
        got = zoo.kv_cached_steps(model, kwargs, latents)
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
        return model

    return run


@pytest.fixture
def tool():
    """A script of tools/ imported as a module, to call its functions in-process: ``tool("zoo_full_size")``."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def fastpath_log(caplog):
    """Records of the package logger (diffusers' loggers do not propagate to the root, where caplog listens)."""
    from diffusers_fastpath._logging import logger

    old = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # where diffusers' root logger does propagate, caplog would see each record twice
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.level, logger.propagate = old


@pytest.fixture
def emulated_kernels(monkeypatch):
    """The fused ops of the shared chains with their guards taking CPU tensors as CUDA ones and their kernels
    replaced by torch code of the same rounding (gated residual: fp32 math, rounded after the multiply and the add,
    as csrc/gated_residual.cu, also ahead of the LayerNorm + modulate in the gated one; its fp32-gate chain rounded
    once) or by their references (the LayerNorm + modulates
    and the QK norm + rotary (every form) and the RMSNorm + scale / gated residual / modulate, self-verified on the GPU; the modulate and the
    rotary and the head concatenation, exact by construction, LTX-Video's rows-form rotary and Wan's as their kernel's
    per-pair arithmetic; the GroupNorm (+ SiLU) of the VAEs, self-verified on the GPU, as its reference; GELU +
    concatenation, the SiLU-gated product (alone or written into a concatenation) and the sigmoid output gate (as its
    kernel's arithmetic), proven exact on every value; the
    VAEs' channel norms, LTX-Video's and LTX-2's VAE norms as their kernels' arithmetic): the fast paths' wiring runs,
    and is checked, on a CPU."""
    from diffusers_fastpath.ops.cat_heads import CAT_HEADS, cat_heads_ref
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL, GATED_RESIDUAL_FP32
    from diffusers_fastpath.ops.gelu_cat import GELU_CAT, gelu_cat_ref
    from diffusers_fastpath.ops.group_norm_silu import GROUP_NORM, GROUP_NORM_SILU, group_norm_ref, group_norm_silu_ref
    from diffusers_fastpath.ops.layernorm_scale_shift import (GATED_LAYERNORM_SCALE_SHIFT, LAYERNORM_AFFINE_FP32,
                                                              LAYERNORM_SCALE_SHIFT, LAYERNORM_SCALE_SHIFT_FP32,
                                                              layernorm_affine_fp32_ref, layernorm_scale_shift_fp32_ref,
                                                              layernorm_scale_shift_ref)
    from diffusers_fastpath.ops.layernorm_modulate import (LAYERNORM_MODULATE, LAYERNORM_SCALE, LAYERNORM_SCALE_ROWS,
                                                           layernorm_modulate_ref, layernorm_scale_ref)
    from diffusers_fastpath.ops.gated_residual import GATED_RESIDUAL_ROWS
    from diffusers_fastpath.ops.gated_layernorm_scale_rows import GATED_LAYERNORM_SCALE_ROWS
    from diffusers_fastpath.ops.modulate_scale_shift import (MODULATE_SCALE_SHIFT, MODULATE_SCALE_SHIFT_ROWS,
                                                             modulate_scale_shift_ref)
    from diffusers_fastpath.ops.qk_norm_rope import (QK_NORM_ROPE, QK_NORM_ROWS_ROPE, QK_NORM_ROWS_ROPE_PAIR,
                                                     qk_norm_rope_ref, qk_norm_rows_rope_pair_ref, qk_norm_rows_rope_ref)
    from diffusers_fastpath.ops.qk_norm_rope_fp32 import (QK_NORM_ROPE_FP32, QK_NORM_ROPE_ZERO_CENTRED,
                                                          qk_norm_rope_fp32_ref, qk_norm_rope_zero_centred_ref)
    from diffusers_fastpath.ops.rotary_half import ROTARY_HALF, ROTARY_HALF_PARTIAL
    from diffusers_fastpath.ops.qk_norm_rotary_half import QK_NORM_ROTARY_HALF
    from diffusers_fastpath.ops.rotary_matrix import ROTARY_MATRIX
    from diffusers_fastpath.ops.rmsnorm_modulate import RMSNORM_MODULATE, rmsnorm_modulate_ref
    from diffusers_fastpath.ops.rmsnorm_scale_shift import (RMSNORM_GATED_RESIDUAL, RMSNORM_GATED_RESIDUAL_ROWS,
                                                            RMSNORM_SCALE, RMSNORM_SCALE_ROWS,
                                                            rmsnorm_gated_residual_ref, rmsnorm_scale_ref)
    from diffusers_fastpath.ops.rmsnorm_rope import (RMSNORM_ROPE_COMPLEX, RMSNORM_ROPE_REAL, rmsnorm_rope_complex_ref,
                                                     rmsnorm_rope_real_ref)
    from diffusers_fastpath.ops.rotary import ROTARY_EMB, ROTARY_EMB_ROWS, ROTARY_EMB_WAN, rotary_emb_ref
    from diffusers_fastpath.ops.sigmoid_mul import SIGMOID_MUL
    from diffusers_fastpath.ops.silu_mul import SILU_MUL, SWIGLU_CAT, silu_mul_ref, swiglu_cat_ref

    def gated_residual_arithmetic(residual, gate, update):
        return (residual.float() + (gate.float() * update.float()).to(residual.dtype).float()).to(residual.dtype)

    def gated_residual_fp32_arithmetic(residual, gate, update):  # fp32 product and sum, one rounding
        return (residual.float() + update.float() * gate).to(residual.dtype)

    def sigmoid_mul_arithmetic(x, gate):  # csrc/silu_mul.cu's sigmoid_mul_kernel: the sigmoid rounded, one product
        return (x.float() * torch.sigmoid(gate.float()).to(x.dtype).float()).to(x.dtype)

    def rotary_rows_arithmetic(x, cos, sin):  # csrc/rotary.cu's rotate_pair: two fp32 products, one sum, one rounding
        xf = x.float()
        out = torch.empty(torch.broadcast_shapes(x.shape, cos.shape))
        out[..., 0::2] = xf[..., 0::2] * cos[..., 0::2] + (-xf[..., 1::2]) * sin[..., 0::2]
        out[..., 1::2] = xf[..., 1::2] * cos[..., 1::2] + xf[..., 0::2] * sin[..., 1::2]
        return out.to(x.dtype)

    def rotary_half_arithmetic(x, cos, sin, fn=None):  # csrc/rotary.cu's rotate_half_kernel: every product rounded
        half, xf, c, s = x.shape[-1] // 2, x.float(), cos.float(), sin.float()

        def r(t):
            return t.to(x.dtype).float()

        lo = r(r(xf[..., :half] * c[..., :half]) + r(-xf[..., half:] * s[..., :half]))
        hi = r(r(xf[..., half:] * c[..., half:]) + r(xf[..., :half] * s[..., half:]))
        return torch.cat([lo, hi], dim=-1).to(x.dtype)

    def rotary_half_partial_arithmetic(x, cos, sin, fn=None):  # the same kernel: tables rounded first, rest copied
        r = cos.shape[-1]
        c, s = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
        return torch.cat([rotary_half_arithmetic(x[..., :r], c, s), x[..., r:]], dim=-1)

    def qk_norm_rotary_half_arithmetic(norm, x, cos, sin, rope_site=None, fn=None):  # the norm (self-verified on
        return rotary_half_partial_arithmetic(norm(x), cos, sin)  # the GPU), then the kernel's rotary roundings

    def rotary_matrix_arithmetic(x, rope, fn=None):  # csrc/rotary.cu's rotary_matrix_kernel: (0 + p0) + (0 + p1)
        p = rope * x.float().unflatten(-1, (-1, 1, 2))  # [..., D/2, 2, 2]: each product rounded once
        return ((0.0 + p[..., 0]) + (0.0 + p[..., 1])).flatten(-2).to(x.dtype)

    def rotary_wan_arithmetic(x, cos, sin):  # csrc/rotary.cu's rotate_pair_wan, per pair
        a, b, c0, s1 = x.float()[..., 0::2], x.float()[..., 1::2], cos[..., 0::2], sin[..., 1::2]
        return torch.stack([a * c0 - b * s1, a * s1 + b * c0], dim=-1).flatten(-2).to(x.dtype)

    def indexed(rows):  # the rows as the kernels read them: the table's row index[b, s] (the tanh on the table)
        index, table = rows.index().long(), rows.table()
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < table.shape[0]):
            raise IndexError("index out of range (the kernel traps)")
        return table[index]

    def modulate_rows_indexed(x, scale, shift):  # the modulate of the rows read through the index
        return x * (1 + indexed(scale)) + indexed(shift)

    def layernorm_scale_rows_indexed(norm, x, rows):
        return layernorm_scale_ref(norm, x, indexed(rows))

    def gated_residual_rows_arithmetic(residual, rows, update):
        return gated_residual_arithmetic(residual, indexed(rows), update)

    def rmsnorm_scale_rows_indexed(norm, x, rows):  # select_per_token's rows read through the index
        return rmsnorm_scale_ref(norm, x, indexed(rows))

    def rmsnorm_gated_residual_rows_indexed(norm, residual, rows, x):
        return rmsnorm_gated_residual_ref(norm, residual, indexed(rows), x)

    def gated_layernorm_scale_rows_indexed(norm, residual, gate, update, scale):  # both rows through their index
        x = gated_residual_arithmetic(residual, indexed(gate), update)
        return x, layernorm_scale_ref(norm, x, indexed(scale))

    def gated_layernorm_arithmetic(norm, residual, gate, update, scale, shift):  # the residual's arithmetic, then the ref
        x = gated_residual_arithmetic(residual, gate, update)
        return x, layernorm_scale_shift_ref(norm, x, scale, shift)

    for op, kernel in ((GATED_RESIDUAL, gated_residual_arithmetic), (GATED_RESIDUAL_FP32, gated_residual_fp32_arithmetic),
                       (LAYERNORM_SCALE_SHIFT, layernorm_scale_shift_ref),
                       (GATED_LAYERNORM_SCALE_SHIFT, gated_layernorm_arithmetic),
                       (LAYERNORM_SCALE_SHIFT_FP32, layernorm_scale_shift_fp32_ref),
                       (LAYERNORM_AFFINE_FP32, layernorm_affine_fp32_ref),
                       (LAYERNORM_MODULATE, layernorm_modulate_ref),  # per-token rows, affine and fp32 norms
                       (LAYERNORM_SCALE, layernorm_scale_ref),  # ... without a shift (Qwen-Image 2.1)
                       (LAYERNORM_SCALE_ROWS, layernorm_scale_rows_indexed),  # ... its where-picked rows, indexed
                       (GATED_RESIDUAL_ROWS, gated_residual_rows_arithmetic),
                       (GATED_LAYERNORM_SCALE_ROWS, gated_layernorm_scale_rows_indexed),  # ... the in-block pair
                       (MODULATE_SCALE_SHIFT_ROWS, modulate_rows_indexed),  # MiniMax-H3's index_select rows
                       (ROTARY_EMB, rotary_emb_ref), (QK_NORM_ROPE, qk_norm_rope_ref), (GELU_CAT, gelu_cat_ref),
                       (SILU_MUL, silu_mul_ref), (SWIGLU_CAT, swiglu_cat_ref), (SIGMOID_MUL, sigmoid_mul_arithmetic),
                       (RMSNORM_SCALE, rmsnorm_scale_ref),
                       (RMSNORM_GATED_RESIDUAL, rmsnorm_gated_residual_ref), (RMSNORM_MODULATE, rmsnorm_modulate_ref),
                       (RMSNORM_SCALE_ROWS, rmsnorm_scale_rows_indexed),  # ... select_per_token's rows, indexed
                       (RMSNORM_GATED_RESIDUAL_ROWS, rmsnorm_gated_residual_rows_indexed),
                       (RMSNORM_ROPE_COMPLEX, rmsnorm_rope_complex_ref), (RMSNORM_ROPE_REAL, rmsnorm_rope_real_ref),
                       (MODULATE_SCALE_SHIFT, modulate_scale_shift_ref), (CAT_HEADS, cat_heads_ref),
                       (ROTARY_EMB_ROWS, rotary_rows_arithmetic), (ROTARY_EMB_WAN, rotary_wan_arithmetic),
                       (QK_NORM_ROWS_ROPE, qk_norm_rows_rope_ref),
                       (QK_NORM_ROWS_ROPE_PAIR, qk_norm_rows_rope_pair_ref),
                       (QK_NORM_ROPE_FP32, qk_norm_rope_fp32_ref),
                       (QK_NORM_ROPE_ZERO_CENTRED, qk_norm_rope_zero_centred_ref), (ROTARY_HALF, rotary_half_arithmetic),
                       (ROTARY_HALF_PARTIAL, rotary_half_partial_arithmetic),
                       (QK_NORM_ROTARY_HALF, qk_norm_rotary_half_arithmetic),
                       (ROTARY_MATRIX, rotary_matrix_arithmetic),
                       (GROUP_NORM, group_norm_ref), (GROUP_NORM_SILU, group_norm_silu_ref)):
        monkeypatch.setattr(op, "guard", _as_if_on_cuda(op.guard))
        monkeypatch.setattr(op, "kernel", kernel)
    for op in (GELU_CAT, SILU_MUL, SWIGLU_CAT, SIGMOID_MUL, GROUP_NORM_SILU):
        monkeypatch.setattr(op, "prove", None)  # their proofs run the CUDA kernel on every value of the dtype
    import sys

    # the VAEs' channel RMS norm (+ SiLU) of Wan and Qwen-Image: the kernel's arithmetic in torch after aten's norm;
    # their causal convolutions' one-buffer input: torch code already (only the guard's device is the GPU's)
    causal_conv_pad = sys.modules["diffusers_fastpath.ops.causal_conv_pad"]  # (ops binds the names to the op functions)
    crms = sys.modules["diffusers_fastpath.ops.channel_rmsnorm_silu"]

    def channel_rmsnorm_launch(x, denom, gamma, bias, scale, bias_value, silu, probe):  # over [rows, C, spatial]
        shape = (-1,) + (1,) * (x.dim() - 2)
        return crms.channel_rmsnorm_arithmetic(x, denom.reshape(x.shape[0], 1, *x.shape[2:]), gamma.reshape(shape),
                                               bias_value if bias is None else bias.reshape(shape), scale,
                                               silu).contiguous()

    # (the op's own wrapper: the layouts, and the result written into the convolution's buffer, `pad_arithmetic`)
    for op in (crms.CHANNEL_RMSNORM, crms.CHANNEL_RMSNORM_SILU):
        monkeypatch.setattr(op, "guard", _as_if_on_cuda(op.guard))
    monkeypatch.setattr(crms, "_raw", channel_rmsnorm_launch)
    monkeypatch.setattr(crms, "_raw_pad", crms.pad_arithmetic)
    monkeypatch.setattr(crms.CHANNEL_RMSNORM_SILU, "prove", None)
    # the boolean attention mask made additive once per forward: its own code, torch's kernel choice taken as the
    # memory-efficient kernel's (a CPU's SDPA converts a boolean mask to that form too); the verification runs
    bool_mask = sys.modules["diffusers_fastpath.ops.attention_bool_mask"]
    monkeypatch.setattr(bool_mask.ATTENTION_BOOL_MASK, "guard", _as_if_on_cuda(bool_mask.ATTENTION_BOOL_MASK.guard))
    monkeypatch.setattr(bool_mask, "SDPA_CHOICE", lambda *args: int(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION))
    monkeypatch.setattr(causal_conv_pad.CAUSAL_CONV3D, "guard", _as_if_on_cuda(causal_conv_pad.CAUSAL_CONV3D.guard))
    monkeypatch.setattr(causal_conv_pad, "_launch", causal_conv_pad.pad_arithmetic)  # csrc/causal_pad.cu's buffer
    # the convolutions' bias add: the whole convolution as torch runs it (a CPU's convolution adds its bias inside,
    # so the convolution without it plus the kernel's add is not the CPU's number; tests/test_conv_bias.py checks
    # the wrapper around the launch apart)
    conv_bias_module = sys.modules["diffusers_fastpath.ops.conv_bias"]
    monkeypatch.setattr(conv_bias_module.CONV_BIAS, "guard", _as_if_on_cuda(conv_bias_module.CONV_BIAS.guard))
    monkeypatch.setattr(conv_bias_module.CONV_BIAS, "kernel", conv_bias_module.conv_bias_ref)
    # the causal convolutions channels-last: the op's own code, the backend taken as cuDNN; the convolution the
    # channels-first one (with its bias: a CPU's convolution adds it inside, as above) with its result laid out
    # channels-last, and the bias and transpose pass a copy to contiguous (a CPU's convolution of a channels-last input
    # is not always the channels-first bits; cuDNN's is the GPU tests' question); its per-signature check against
    # eager runs as on the GPU
    causal_conv_cl = sys.modules["diffusers_fastpath.ops.causal_conv_cl"]
    monkeypatch.setattr(causal_conv_cl.CAUSAL_CONV3D_CL, "guard", _as_if_on_cuda(causal_conv_cl.CAUSAL_CONV3D_CL.guard))
    monkeypatch.setattr(causal_conv_cl, "_backend", lambda *args: torch._C._ConvBackend.Cudnn)
    monkeypatch.setattr(causal_conv_cl, "_convolution", lambda conv, padded, padding: torch.nn.functional.conv3d(
        padded.contiguous(), conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups).contiguous(
        memory_format=torch.channels_last_3d))
    monkeypatch.setattr(conv_bias_module, "_contiguous_op", lambda x, bias: x.contiguous())
    # a GroupNorm VAE's norm -> SiLU -> convolution (FLUX.1's): its own code, the norm's channels-last launch its
    # reference laid out channels-last, the convolution the channels-first one (with its bias, as above) laid out
    # channels-last, the bias and transpose pass the copy above; its proof (the SiLU on every value) runs the CUDA
    # kernel's probe mode
    gn_conv = sys.modules["diffusers_fastpath.ops.group_norm_silu_conv"]
    monkeypatch.setattr(gn_conv.GROUP_NORM_SILU_CONV, "guard", _as_if_on_cuda(gn_conv.GROUP_NORM_SILU_CONV.guard))
    monkeypatch.setattr(gn_conv.GROUP_NORM_SILU_CONV, "prove", None)
    monkeypatch.setattr(gn_conv, "_norm_channels_last", lambda norm, x: group_norm_silu_ref(norm, x).contiguous(
        memory_format=torch.channels_last))
    monkeypatch.setattr(gn_conv, "_convolution", lambda conv, y: conv_bias_module.conv_bias_ref(
        conv, y.contiguous()).contiguous(memory_format=torch.channels_last))
    # LTX-Video's and LTX-2's causal convolutions: the op's own code, its buffer `pad_arithmetic` (above: the kernel's
    # source index of each element, the repeated frames and the reflected border included), the convolution
    # causal_conv_cl's (`convolve_channels_last`, as emulated above)
    ltx_conv = sys.modules["diffusers_fastpath.ops.ltx_causal_conv"]
    monkeypatch.setattr(ltx_conv.LTX_CAUSAL_CONV3D, "guard", _as_if_on_cuda(ltx_conv.LTX_CAUSAL_CONV3D.guard))
    # their decoders' 2x upsampling: csrc/upsample_nearest.cu's arithmetic, each value's float round trip in its 2x2
    upsample = sys.modules["diffusers_fastpath.ops.upsample_nearest"]
    monkeypatch.setattr(upsample.UPSAMPLE_NEAREST2X, "guard", _as_if_on_cuda(upsample.UPSAMPLE_NEAREST2X.guard))
    monkeypatch.setattr(upsample.UPSAMPLE_NEAREST2X, "kernel", lambda module, x: x.float().to(x.dtype).repeat_interleave(
        2, dim=-1).repeat_interleave(2, dim=-2).contiguous())  # (contiguous whatever x's strides, as the kernel's)
    # LTX-Video's VAE norm (+ SiLU): its own kernel wrapper (aten's reduction and rsqrt, the [B, C, spatial] memory),
    # the launch replaced by the kernel's arithmetic (the multiply, the cast, the SiLU) on the tensors it is given; the
    # pair's proof (the SiLU on every value) runs the CUDA kernel's probe mode
    ltx_norm = sys.modules["diffusers_fastpath.ops.ltx_vae_rmsnorm"]
    for op in (ltx_norm.LTX_RMSNORM, ltx_norm.LTX_VAE_RMSNORM_SILU):
        monkeypatch.setattr(op, "guard", _as_if_on_cuda(op.guard))
    monkeypatch.setattr(ltx_norm.LTX_VAE_RMSNORM_SILU, "prove", None)
    monkeypatch.setattr(ltx_norm, "_launch", ltx_norm.launch_arithmetic)
    # LTX-2's VAE norm -> SiLU -> causal convolution: its own code, the mean's order taken as a GPU's (a CPU has
    # none), the pad kernel's launch its arithmetic with the CPU's own mean (as the norm's emulation below: aten's
    # order on the device that runs it), the convolution causal_conv_cl's as emulated above; its proofs (the sqrt and
    # the SiLU on every value) run the CUDA kernel's probe modes
    norm_conv = sys.modules["diffusers_fastpath.ops.ltx_norm_conv"]
    monkeypatch.setattr(norm_conv.LTX_NORM_CONV, "guard", _as_if_on_cuda(norm_conv.LTX_NORM_CONV.guard))
    monkeypatch.setattr(norm_conv.LTX_NORM_CONV, "prove", None)
    monkeypatch.setattr(norm_conv, "_mean_order", lambda x: norm_conv._norm.MeanOrder(1, 1, 1.0 / x.shape[1]))
    monkeypatch.setattr(norm_conv, "_launch", lambda x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw: (
        norm_conv.norm_pad_arithmetic(x, torch.mean(x**2, dim=1), eps, silu, dims, padding, reflect_hw)))
    # LTX-Video's VAE norm -> SiLU -> causal convolution: its own code (aten's reduction and rsqrt, the squares as the
    # norm's emulation above), the kernel's launch its arithmetic (the pair's, then causal_pad's buffer of it), the
    # convolution causal_conv_cl's as emulated above; its proof (the tail on every value) runs the CUDA kernel
    ltx_norm_conv = sys.modules["diffusers_fastpath.ops.ltx_vae_rmsnorm_conv"]
    monkeypatch.setattr(ltx_norm_conv.LTX_VAE_RMSNORM_CONV, "guard",
                        _as_if_on_cuda(ltx_norm_conv.LTX_VAE_RMSNORM_CONV.guard))
    monkeypatch.setattr(ltx_norm_conv.LTX_VAE_RMSNORM_CONV, "prove", None)
    monkeypatch.setattr(ltx_norm_conv, "_launch", ltx_norm_conv.norm_pad_arithmetic)
    # its fused kernel where x is dense (the order an H100's, the mean the CPU's own: eager's calls on the view)
    monkeypatch.setattr(ltx_norm_conv, "_mean_order", lambda x: ltx_norm_conv.mean_order(x, (132, 2048)))

    def ltx_fused(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe):
        view = x.reshape(*x.shape[:2], *dims).movedim(1, -1)
        mean = view.to(torch.float32).pow(2).mean(-1).reshape(x.shape[0], -1)
        return ltx_norm_conv.fused_pad_arithmetic(x, mean, eps, silu, dims, padding, reflect_hw)

    monkeypatch.setattr(ltx_norm_conv, "_launch_fused", ltx_fused)
    # ... and reading the convolution before it channels-last, its bias not added (`ltx_bias_norm_conv`): its own code,
    # the kernel's launch its arithmetic on the first convolution's tensor as the emulated convolution above leaves it
    # (a CPU's convolution adds the bias inside: the bias and transpose pass a copy), the mean the CPU's own; its
    # proofs run the CUDA kernel's probe modes
    bias_norm_conv = sys.modules["diffusers_fastpath.ops.ltx_bias_norm_conv"]
    monkeypatch.setattr(bias_norm_conv.LTX_BIAS_NORM_CONV, "guard", _as_if_on_cuda(bias_norm_conv.LTX_BIAS_NORM_CONV.guard))
    monkeypatch.setattr(bias_norm_conv.LTX_BIAS_NORM_CONV, "prove", None)
    monkeypatch.setattr(bias_norm_conv, "_launch", lambda raw, bias, eps, silu, rows, ctas, factor, padding, reflect_hw: (
        bias_norm_conv.bias_norm_pad_arithmetic(raw, bias, eps, silu, padding, reflect_hw,
                                                biased=lambda raw, bias: conv_bias_module._contiguous_op(raw, bias))))
    # ... and the residual add reading the second convolution's result (`conv_bias_residual`): its own code, the
    # kernel's launch its arithmetic (bias_contiguous's tensor, then aten's add of the residual, each rounded) on the
    # convolution's tensor as the emulated convolution above leaves it (the bias inside: the bias and transpose pass a
    # copy)
    conv_residual = sys.modules["diffusers_fastpath.ops.conv_bias_residual"]
    monkeypatch.setattr(conv_residual.CONV_BIAS_RESIDUAL, "guard", _as_if_on_cuda(conv_residual.CONV_BIAS_RESIDUAL.guard))
    monkeypatch.setattr(conv_bias_module, "_residual_op", lambda raw, bias, residual: (
        conv_bias_module.bias_residual_contiguous_arithmetic(
            raw, bias, residual, biased=lambda raw, bias: conv_bias_module._contiguous_op(raw, bias))))
    # LTX-Video's and LTX-2's residual upsamplers (`ltx_upsampler3d`): its own code, the convolution causal_conv_cl's
    # as emulated above, the kernel's launch its arithmetic (bias_contiguous's tensor, the depth-to-space moves of it
    # and of the input, then aten's add) on the convolution's tensor as the emulated convolution leaves it (the bias
    # inside: the bias and transpose pass a copy)
    upsampler = sys.modules["diffusers_fastpath.ops.ltx_upsampler"]
    monkeypatch.setattr(upsampler.LTX_UPSAMPLER3D, "guard", _as_if_on_cuda(upsampler.LTX_UPSAMPLER3D.guard))
    monkeypatch.setattr(conv_bias_module, "_depth_to_space_op", lambda raw, bias, residual: (
        conv_bias_module.depth_to_space_residual_arithmetic(
            raw, bias, residual, biased=lambda raw, bias: conv_bias_module._contiguous_op(raw, bias))))
    # LTX-2's VAE norm (+ SiLU): its own kernel wrapper (aten's square and mean, x's [B, C, S] memory), the launch
    # replaced by the kernel's arithmetic (the eps add, sqrt, division, SiLU, each rounded) on the tensors it is given;
    # its proofs (the sqrt and the SiLU on every value) run the CUDA kernel's probe modes
    per_channel = sys.modules["diffusers_fastpath.ops.per_channel_rmsnorm"]
    for op in (per_channel.PER_CHANNEL_RMSNORM, per_channel.PER_CHANNEL_RMSNORM_SILU):
        monkeypatch.setattr(op, "guard", _as_if_on_cuda(op.guard))
        monkeypatch.setattr(op, "prove", None)
    monkeypatch.setattr(per_channel, "_launch", lambda x, mean, eps, silu, probe: (
        per_channel.per_channel_rmsnorm_arithmetic(x, mean.view(x.shape[0], 1, -1), eps, silu).contiguous()))
    # the plain QK norm: its own kernel wrapper (the rows in memory order, the result in x's strides), the launch
    # replaced by the eager norm of those rows
    import sys

    from diffusers_fastpath.ops.rmsnorm_scale_shift import _rms_norm

    rmsnorm_module = sys.modules["diffusers_fastpath.ops.rmsnorm"]  # (the package's `rmsnorm` is the op function)
    # Krea 2's zero-centred norm: its own kernel wrapper (the forward's weight + 1.0, the rows), the launch replaced
    # by aten's rms_norm of the upcast rows with that weight, cast back
    zero_centred = sys.modules["diffusers_fastpath.ops.zero_centred_rmsnorm"]
    monkeypatch.setattr(zero_centred.ZERO_CENTRED_RMSNORM, "guard", _as_if_on_cuda(zero_centred.ZERO_CENTRED_RMSNORM.guard))
    monkeypatch.setattr(zero_centred, "_launch", lambda x, weight, eps, final: torch.nn.functional.rms_norm(
        x.float(), (x.shape[-1],), weight=weight, eps=eps).to(x.dtype))
    # ... and with the modulate after it: its own kernel wrapper (the weight + 1.0, the [B or 1, D] rows), the launch
    # replaced by that norm, then the modulate's three roundings in x's dtype
    zc_modulate = sys.modules["diffusers_fastpath.ops.zero_centred_modulate"]
    monkeypatch.setattr(zc_modulate.ZERO_CENTRED_MODULATE, "guard",
                        _as_if_on_cuda(zc_modulate.ZERO_CENTRED_MODULATE.guard))
    monkeypatch.setattr(zc_modulate, "_launch", lambda x, weight, scale, shift, eps, final: (
        zc_modulate.zero_centred_modulate_arithmetic(x, weight, scale, shift, eps)))
    # torch.nn.RMSNorm with the modulate of rows read through an index (MiniMax-H3's): its own kernel wrapper (x's
    # [1, N, D] rows, the tables, the int32 index), the launch replaced by the CPU's rms_norm of x, then the table rows
    # the index picks (out of range: IndexError, where the kernel traps) and the modulate's three roundings
    rms_rows = sys.modules["diffusers_fastpath.ops.rms_norm_modulate_rows"]
    monkeypatch.setattr(rms_rows.RMS_NORM_MODULATE_ROWS, "guard", _as_if_on_cuda(rms_rows.RMS_NORM_MODULATE_ROWS.guard))
    monkeypatch.setattr(rms_rows, "_launch", lambda x, weight, scale, shift, index, eps, final: (
        rms_rows.rms_norm_modulate_rows_arithmetic(x, weight, scale, shift, index, eps)))

    monkeypatch.setattr(rmsnorm_module.RMSNORM, "guard", _as_if_on_cuda(rmsnorm_module.RMSNORM.guard))
    monkeypatch.setattr(rmsnorm_module, "_launch", lambda x, weight, eps: _rms_norm(x, weight, eps).contiguous())
    # the two streams' QK norm + rotary written into their joint tensor: its own kernel wrapper (the slices of the
    # joint output), each launch replaced by the eager chain of its rows written into its `out` slice
    from diffusers_fastpath.ops import rmsnorm_rope as rmsnorm_rope_module
    from diffusers_fastpath.ops.rmsnorm_rope import RMSNORM_ROPE_COMPLEX_CAT, rope_complex

    def rope_complex_rows_out(out, x, weight, pairs, heads, tokens, eps):
        rows, _, dim = x.shape
        freqs = torch.view_as_complex(pairs.unflatten(-1, (-1, 2)))
        y = rope_complex(_rms_norm(x.view(-1, tokens, heads, dim), weight, eps), freqs[0] if len(freqs) == 1 else freqs)
        out.copy_(y.reshape(rows, 1, dim))

    monkeypatch.setattr(RMSNORM_ROPE_COMPLEX_CAT, "guard", _as_if_on_cuda(RMSNORM_ROPE_COMPLEX_CAT.guard))
    monkeypatch.setattr(rmsnorm_rope_module, "_launch_out", rope_complex_rows_out)
    # ... and a key written after its cached prefix (Qwen-Image 2.1): the same launch, after the op's copy of the prefix
    from diffusers_fastpath.ops.rmsnorm_rope_prefix import RMSNORM_ROPE_COMPLEX_PREFIX

    monkeypatch.setattr(RMSNORM_ROPE_COMPLEX_PREFIX, "guard", _as_if_on_cuda(RMSNORM_ROPE_COMPLEX_PREFIX.guard))
    # SD3's token-major head concatenations and their attention: aten's ops, as on the GPU (the attention verifies
    # itself on its first call per signature, here against the CPU's attention on contiguous copies)
    from diffusers_fastpath.ops import attention_seq_major as attention_module

    monkeypatch.setattr(attention_module, "ATTENTION_SEQ_MAJOR_GUARD",
                        _as_if_on_cuda(attention_module.ATTENTION_SEQ_MAJOR_GUARD))
    # the joint value projections: aten's addmm into the rows of the joint tensor, as on the GPU (self-verified there;
    # here against the CPU's F.linear and torch.cat)
    from diffusers_fastpath.ops.linear_cat import LINEAR_CAT

    monkeypatch.setattr(LINEAR_CAT, "guard", _as_if_on_cuda(LINEAR_CAT.guard))
    # ... and a projection written after its cached prefix (Qwen-Image 2.1's value): aten's addmm into the rows, too
    from diffusers_fastpath.ops.linear_prefix import LINEAR_PREFIX

    monkeypatch.setattr(LINEAR_PREFIX, "guard", _as_if_on_cuda(LINEAR_PREFIX.guard))


def _as_if_on_cuda(guard):
    """The op's own guard (dtypes, shapes, strides, contiguity: what a model's layout decides), with the device and
    the pointers it checks last taken as a GPU's: a site whose tensors the kernel would refuse on the GPU falls back
    here too (a view that is contiguous only at batch 1, say)."""
    def on_cpu(*args, check_pointers=True):
        reason = guard(*args, check_pointers=False)
        return None if reason == "device cpu" else reason
    return on_cpu
