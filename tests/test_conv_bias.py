"""conv_bias (a VAE convolution's bias added in one vectorised pass after cuDNN's convolution, as aten adds it): the
reference is torch's convolution forward; the guard's reasons; the wrapper around the launch (the convolution without
its bias, the kernel's add in place on that very tensor, aten's own add for another layout) and the NVRTC launch's
arguments on a CPU; on the GPU the kernel against aten's add with poisoned-free in-place checks at the FLUX.1 and Wan
decodes' shapes, both layouts, the vector and the element paths, and the op through the modules."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from diffusers_fastpath._state import site_attr
from diffusers_fastpath.models.vae_conv import FastpathConv2d, FastpathConv3d
from diffusers_fastpath.ops import Site, conv_bias, conv_bias_ref
from diffusers_fastpath.ops._policy import REASON_FORWARD_REPLACED

module = sys.modules["diffusers_fastpath.ops.conv_bias"]
CONV_BIAS = module.CONV_BIAS


def make(cls=FastpathConv2d, cin=8, cout=16, dtype=torch.bfloat16, device="cpu", seed=0, **kwargs):
    torch.manual_seed(seed)
    conv = cls(cin, cout, 3, padding=1, **kwargs).to(device=device, dtype=dtype)
    conv.__dict__[site_attr()] = Site("conv_bias")  # (as `patch` gives it: the guard takes only patched modules)
    with torch.no_grad():
        if conv.bias is not None:
            conv.bias.copy_(torch.randn(cout) * 2)  # not the default's small values: the add must round
    return conv


def test_reference_is_torchs_convolution():
    conv = make()
    x = torch.randn(1, 8, 6, 6).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(conv_bias_ref(conv, x), nn.Conv2d.forward(conv, x))
        assert torch.equal(conv(x), nn.Conv2d.forward(conv, x))  # on a CPU the guard refuses: torch's forward
    conv3 = make(FastpathConv3d)
    x3 = torch.randn(1, 8, 3, 6, 6).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(conv_bias_ref(conv3, x3), nn.Conv3d.forward(conv3, x3))


@pytest.mark.parametrize("case, reason", [
    ("plain", "Conv2d is not a checked convolution"), ("no bias", "no bias"), ("reflect", "padding mode"),
    ("same", "padding not integers"), ("unbatched", "x not batched"), ("fp64", "dtype float64"),
    ("mixed", "mixed dtypes"), ("empty", "empty"), ("grad", "requires grad"), ("cpu", "device cpu")])
def test_guard_falls_back_with_reason(case, reason):
    conv, x = make(), torch.randn(1, 8, 6, 6).to(torch.bfloat16)
    if case == "plain":
        conv = nn.Conv2d(8, 16, 3, padding=1).to(torch.bfloat16)
    elif case == "no bias":
        conv = make(bias=False)
    elif case == "reflect":
        conv = make(padding_mode="reflect")
    elif case == "same":
        conv = FastpathConv2d(8, 16, 3, padding="same").to(torch.bfloat16)
        conv.__dict__[site_attr()] = Site("conv_bias")
    elif case == "unbatched":
        x = x[0]
    elif case == "fp64":  # (fp32 runs: an fp32 VAE's bias add is one fp32 add too)
        conv, x = conv.double(), x.double()
    elif case == "mixed":
        conv = conv.float()
    elif case == "empty":
        x = x[:0]
    site = Site("conv_bias")
    with torch.set_grad_enabled(case == "grad"):
        if case != "grad":
            conv.requires_grad_(False)
        assert CONV_BIAS.guard(conv, x) == reason
        if case == "mixed":  # eager raises (bf16 input, fp32 weight): so does the fallback, the same error
            with pytest.raises(RuntimeError, match="should be the same"):
                conv_bias(conv, x, site)
            return
        assert torch.equal(conv_bias(conv, x, site), nn.Conv2d.forward(conv, x))
    assert site.fast == 0 and site.fallback == {reason: 1}


def test_a_forward_replaced_on_torchs_class_is_refused(monkeypatch):
    original = nn.Conv2d.forward
    monkeypatch.setattr(nn.Conv2d, "forward", lambda self, x: original(self, x) * 2)
    conv, x = make(), torch.randn(1, 8, 6, 6).to(torch.bfloat16)
    assert CONV_BIAS.guard(conv, x) == REASON_FORWARD_REPLACED.format("FastpathConv2d")


def _emulated_launch(calls):
    def launch(out, bias):  # csrc/conv_bias.cu's arithmetic, in place: round(float(x) + float(bias[c]))
        calls.append((out, bias))
        view = bias.float().reshape(1, -1, *([1] * (out.dim() - 2)))
        out.copy_((out.float() + view).to(out.dtype))

    return launch


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "channels_last_3d"])
def test_kernel_wrapper_convolves_without_bias_then_adds_it_in_place(layout, monkeypatch):
    """The wrapper (its launch emulated by the kernel's arithmetic): the convolution without its bias (what cuDNN
    computes), the bias added in place on that tensor, returned in its layout."""
    calls = []
    monkeypatch.setattr(module, "_cuda_op", _emulated_launch(calls))
    cls, shape = (FastpathConv3d, (2, 8, 3, 6, 6)) if layout.endswith("3d") else (FastpathConv2d, (2, 8, 6, 6))
    conv = make(cls)
    x = torch.randn(shape).to(torch.bfloat16)
    if layout != "contiguous":
        x = x.contiguous(memory_format=getattr(torch, layout))
        conv = conv.to(memory_format=getattr(torch, layout))
    with torch.no_grad():
        plain = conv._conv_forward(x, conv.weight, None)
        out = module._kernel(conv, x)
    (launched, bias), = calls
    assert launched is out and bias is conv.bias
    assert out.stride() == plain.stride() and out.is_contiguous() == (layout == "contiguous")
    view = conv.bias.float().reshape(1, -1, *([1] * (x.dim() - 2)))
    assert torch.equal(out, (plain.float() + view).to(torch.bfloat16))


def test_kernel_wrapper_adds_as_aten_where_the_output_has_another_layout(monkeypatch):
    calls = []
    monkeypatch.setattr(module, "_cuda_op", _emulated_launch(calls))
    conv, x = make(), torch.randn(2, 8, 6, 6).to(torch.bfloat16)
    odd = torch.randn(2, 6, 16, 6).to(torch.bfloat16).transpose(1, 2)  # neither contiguous nor channels-last
    monkeypatch.setattr(conv, "_conv_forward", lambda *args: odd)
    expected = odd.clone().add_(conv.bias.detach().reshape(1, -1, 1, 1))
    with torch.no_grad():
        assert module._kernel(conv, x) is odd
    assert not calls and torch.equal(odd, expected)


def test_the_guard_reads_the_sites_patch_gives():
    causal = sys.modules["diffusers_fastpath.ops.causal_conv_pad"]
    assert causal._BIAS_SITE == module.NAMED_SITE == site_attr(CONV_BIAS.name) and module.SITE == site_attr()


def test_a_module_of_the_class_that_patch_did_not_make_is_refused():
    """PEFT's LoRA layers copy their base layer's class (``type(base_layer)(...)``): made while patched, they are of
    this package's class with no site, and run torch's forward."""
    conv = make()
    del conv.__dict__[site_attr()]
    x = torch.randn(1, 8, 6, 6).to(torch.bfloat16)
    with torch.no_grad():
        assert CONV_BIAS.guard(conv, x) == "not patched"
        assert torch.equal(conv(x), nn.Conv2d.forward(conv, x))


def test_the_guard_asks_no_backend_while_compiling(monkeypatch):
    """Under torch.compile the op is the module's own forward: the guard asks torch for no convolution backend (a
    query dynamo cannot trace: ``_select_conv_backend`` returns no tensor)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(module, "_backend", lambda *args: pytest.fail("asked for a backend while compiling"))
    conv, x = make(), torch.randn(1, 8, 6, 6).to(torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with torch.no_grad():
        assert CONV_BIAS.guard(conv, x) is None


def test_the_guard_says_shape_where_aten_refuses_the_shape(monkeypatch):
    """aten's backend query checks the shapes first (a channel count the weight does not take raises there, as eager
    raises): the guard answers "shape" and never raises."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(module, "_backend", lambda *args: torch._C._select_conv_backend(
        torch.empty(1, 5, 6, 6), torch.empty(16, 8, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, None))
    conv, x = make(), torch.randn(1, 5, 6, 6).to(torch.bfloat16)
    with torch.no_grad():
        assert CONV_BIAS.guard(conv, x) == "shape"


@pytest.mark.parametrize("shape, layout, key, grid, rows, cols", [
    ((2, 16, 4, 8), "contiguous", (torch.bfloat16, False, True), (1, 32, 1), 32, 32),
    ((1, 16, 3, 5), "contiguous", (torch.bfloat16, False, False), (1, 16, 1), 16, 15),
    ((2, 16, 4, 8), "channels_last", (torch.bfloat16, True, True), (1, 64, 1), 64, 16),
    ((1, 12, 2, 3, 4), "channels_last_3d", (torch.bfloat16, True, False), (1, 24, 1), 24, 12),
    ((1, 8, 700, 300), "contiguous", (torch.float16, False, True), (103, 8, 1), 8, 210000),
])
def test_nvrtc_launch_arguments(shape, layout, key, grid, rows, cols, monkeypatch):
    """The NVRTC way's launch: the output seen as [rows, cols] (planes x spatial, or positions x channels), the
    16-byte vector path where cols is a multiple of 8 elements and x aligned, the element path otherwise."""
    from diffusers_fastpath.ops import _nvrtc

    launches = []
    monkeypatch.setattr(module._NVRTC, "launch", lambda *args: launches.append(args))
    x = torch.randn(shape).to(key[0])
    if layout != "contiguous":
        x = x.contiguous(memory_format=getattr(torch, layout))
    bias = torch.randn(shape[1]).to(key[0])
    module._nvrtc_kernel(x, bias)
    (device, got_key, got_grid, block, *args), = launches
    assert (got_key, got_grid, block) == (key, grid, (256, 1, 1))
    assert args == [x.data_ptr(), bias.data_ptr(), rows, cols, shape[1], _nvrtc.DTYPE_CODE[key[0]], key[1]]


def test_raw_op_guard_refuses_what_bindings_refuse():
    x = torch.randn(1, 4, 3, 3).to(torch.bfloat16)
    assert module._raw_guard(x, torch.randn(4).to(torch.bfloat16)) == "shape, dtype or layout"  # (a CPU tensor)
    assert module._raw_guard(x, torch.randn(5).to(torch.bfloat16)) == "shape, dtype or layout"


# --- on the GPU -----------------------------------------------------------------------------------------------------

SHAPES = [  # the FLUX.1 decode's (1024x1024 at 128 channels, 128x128 at 512), Wan's 5-D, an odd spatial size
    ((1, 128, 1024, 1024), "contiguous"), ((1, 512, 128, 128), "contiguous"), ((1, 384, 4, 60, 104), "contiguous"),
    ((1, 64, 83, 83), "contiguous"), ((2, 128, 64, 64), "channels_last"), ((1, 96, 2, 30, 52), "channels_last_3d"),
    ((1, 20, 9, 9), "channels_last")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape, layout", SHAPES, ids=str)
def test_kernel_matches_atens_bias_add_on_the_gpu(shape, layout, dtype):
    """The raw op in place against aten's ``add_`` of the reshaped bias (what Convolution.cpp runs after cuDNN): every
    element equal, the vector path and the element path (a misaligned view), both layouts."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for offset in (0, 1):  # 1: a view one element in, not 16-byte aligned (the element path)
        base = (torch.randn(int(torch.tensor(shape).prod()) + offset, generator=gen, device="cuda") * 4).to(dtype)
        x = base[offset:].view(shape)
        if layout != "contiguous":
            x = x.permute(0, *range(2, len(shape)), 1).contiguous().permute(0, len(shape) - 1, *range(1, len(shape) - 1))
            assert x.is_contiguous(memory_format=getattr(torch, layout))
        bias = (torch.randn(shape[1], generator=gen, device="cuda") * 3).to(dtype)
        ref = x.clone(memory_format=torch.preserve_format).add_(bias.reshape(1, -1, *([1] * (len(shape) - 2))))
        torch.ops.diffusers_fastpath._conv_bias_cuda_(x, bias)
        torch.cuda.synchronize()
        assert torch.equal(x, ref) and x.stride() == ref.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("cls, shape", [(FastpathConv2d, (1, 128, 256, 256)), (FastpathConv3d, (1, 96, 3, 60, 104)),
                                        (FastpathConv2d, (2, 64, 83, 83))], ids=str)
def test_op_matches_the_module_on_the_gpu(cls, shape):
    """The convolution modules through the op: equal to torch's forward with its bias, fast, verified; also
    channels-last."""
    from diffusers_fastpath.ops._build import load_extension

    load_extension()
    conv = make(cls, cin=shape[1], cout=shape[1], device="cuda")
    with torch.no_grad():
        for channels_last in (False, True):
            x = (torch.randn(shape, device="cuda") * 2).to(torch.bfloat16)
            if channels_last:
                fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                x, conv = x.contiguous(memory_format=fmt), conv.to(memory_format=fmt)
            ref = (nn.Conv3d if x.dim() == 5 else nn.Conv2d).forward(conv, x)
            site = Site("conv_bias")
            got = conv_bias(conv, x, site)
            assert torch.equal(got, ref) and got.stride() == ref.stride()
            assert site.fast == 1 and not site.fallback, site
    assert CONV_BIAS.disabled is None
