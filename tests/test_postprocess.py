"""`diffusers_fastpath.postprocess`: a video pipeline's ``postprocess_video(video, "np")`` through pinned, chunked
host copies gives diffusers' array (shape, dtype, strides, bytes). On CPU the chunked, double-buffered copy runs
emulated (`_device_ok` lets a CPU tensor through; the copies are plain ones); on the GPU the pinned path itself."""

from __future__ import annotations

import copy
import functools
import pickle

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.video_processor import VideoProcessor

import diffusers_fastpath as fp
from diffusers_fastpath import postprocess as pp


@pytest.fixture(autouse=True)
def _fresh():
    pp.reset()
    yield
    pp.reset()


@pytest.fixture
def emulated(monkeypatch):
    """The fast path taken for a CPU tensor: the same chunks, buffers and conversions, plain copies for the D2H."""
    monkeypatch.setattr(pp, "_device_ok", lambda video: True)


def corrupt_copies(monkeypatch) -> None:
    """Every pinned copy writes 0.25 over the last value of its buffer (a broken copy the first call's check must
    catch)."""
    real = pp._copy_async

    def corrupting(dst, src):
        token = real(dst, src)
        dst.view(-1)[-1] = 0.25
        return token

    monkeypatch.setattr(pp, "_copy_async", corrupting)


def corrupt_conversion(monkeypatch) -> None:
    """The device's uint8 conversion off by one in its last byte (a broken conversion the first call's check must
    catch)."""
    real = pp._to_uint8

    def off_by_one(x):
        out = real(x)
        out.view(-1)[-1] ^= 1
        return out

    monkeypatch.setattr(pp, "_to_uint8", off_by_one)


def raising_copies(monkeypatch, message: str) -> None:
    """Every pinned copy raises RuntimeError(message)."""
    def broken(dst, src):
        raise RuntimeError(message)

    monkeypatch.setattr(pp, "_copy_async", broken)


def original(processor, video, output_type="np", **kwargs):
    return VideoProcessor.postprocess_video(processor, video, output_type, **kwargs)


def same(got, ref) -> bool:
    return (type(got) is type(ref) is np.ndarray and got.shape == ref.shape and got.dtype == ref.dtype
            and got.strides == ref.strides and got.tobytes() == ref.tobytes())


def video(shape, dtype, seed=0, specials=True, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    v = (torch.randn(shape, generator=gen) * 1.5).to(dtype)
    if specials:
        flat = v.view(-1)
        for i, x in zip((0, 5, 11, 17), (float("nan"), float("inf"), -float("inf"), float("nan"))):
            if i < flat.numel():
                flat[i] = x
        if dtype in (torch.bfloat16, torch.float32) and flat.numel() > 20:  # a NaN with a payload of its own
            bits = flat.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
            bits[20] = 0x7FA3 if dtype == torch.bfloat16 else 0x7FC01234
    return v.to(device)


SHAPES = [(1, 3, 5, 4, 6), (2, 3, 5, 4, 6), (1, 3, 1, 4, 6), (2, 3, 1, 5, 7), (2, 1, 3, 3, 5), (1, 1, 1, 1, 1),
          (3, 2, 1, 1, 7)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [6, 14, 1 << 20])
@pytest.mark.parametrize("normalize", [True, False])
def test_emulated_fast_path_equals_diffusers(emulated, dtype, shape, chunk_bytes, normalize):
    """NaN (with payloads), inf, chunks that do not divide the frames, one frame, one channel, batches of 2 and 3:
    diffusers' array to the bit, its strides too (those of size-1 dimensions read from diffusers)."""
    proc = VideoProcessor(do_normalize=normalize)
    v = video(shape, dtype)
    got = pp.fast_postprocess_video(proc, v, _chunk_bytes=chunk_bytes)
    assert same(got, original(proc, v))
    assert pp.STATS.fast == 1 and not pp.STATS.fallback and not pp._disabled
    again = pp.fast_postprocess_video(proc, video(shape, dtype, seed=1), _chunk_bytes=chunk_bytes)  # verified now
    assert same(again, original(proc, video(shape, dtype, seed=1))) and pp.STATS.fast == 2


@pytest.mark.parametrize("shape", [(1, 3, 4, 4, 6), (2, 2, 2, 2, 8)], ids=str)
@pytest.mark.parametrize("chunk_bytes", [16, 48, 1 << 20])
def test_emulated_fast_path_fp16(emulated, shape, chunk_bytes):
    """fp16 with NaN and inf where the CPU converts every chunk in its vector loop (element counts of 8): equal to
    the bit. (The CPU's scalar loop gives fp16's NaN another payload than its vector loop: see the next test.)"""
    v = video(shape, torch.float16)
    got = pp.fast_postprocess_video(VideoProcessor(), v, _chunk_bytes=chunk_bytes)
    assert same(got, original(VideoProcessor(), v)) and pp.STATS.fast == 1


@pytest.mark.parametrize("chunk_bytes", [6, 14])
def test_fp16_nan_payloads_never_differ_on_a_first_call(emulated, chunk_bytes):
    """fp16 NaN through chunks that end in the CPU's scalar loop (which gives a NaN another payload than the vector
    loop diffusers' one conversion used): the first call's check finds the difference, or there is none; either way
    that call returns diffusers' bytes."""
    proc, v = VideoProcessor(), video((1, 3, 5, 4, 6), torch.float16)
    got = pp.fast_postprocess_video(proc, v, _chunk_bytes=chunk_bytes)
    assert same(got, original(proc, v))
    assert bool(pp._disabled) == (pp.STATS.fast == 0)


def test_fp16_without_nan_any_chunks(emulated):
    for shape in SHAPES:
        v = video(shape, torch.float16, specials=False)
        got = pp.fast_postprocess_video(VideoProcessor(), v, _chunk_bytes=6)
        assert same(got, original(VideoProcessor(), v)), shape
    assert pp.STATS.fast == len(SHAPES) and not pp._disabled


class OwnPostprocess(VideoProcessor):
    def postprocess(self, image, output_type="pil", do_denormalize=None):
        return super().postprocess(image, output_type, do_denormalize)


class OwnDenormalize(VideoProcessor):
    @staticmethod
    def denormalize(images):
        return images.clamp(0, 1)


@pytest.mark.parametrize("case", ["pt", "latent", "kwargs", "subclass", "denormalize", "instance",
                                  "noncontiguous", "4d", "int", "empty"])
def test_refusals_return_the_original(emulated, case):
    proc, v, kwargs, out = VideoProcessor(), video((2, 3, 2, 4, 6), torch.bfloat16, specials=False), {}, "np"
    if case in ("pt", "latent"):
        out = case
    elif case == "kwargs":
        kwargs = {"do_denormalize": [True, False]}
    elif case == "subclass":
        proc = OwnPostprocess()
    elif case == "denormalize":
        proc = OwnDenormalize()
    elif case == "instance":
        proc.pt_to_numpy = VaeImageProcessor.pt_to_numpy
    elif case == "noncontiguous":
        v = v.transpose(3, 4)
    elif case == "4d":
        v = v[0]
    elif case == "int":
        v = (v * 100).to(torch.int16)
    elif case == "empty":
        v = v[:, :, :0]
    if case in ("4d", "latent"):  # diffusers' own error, raised by diffusers' own code
        with pytest.raises(Exception) as want:
            original(proc, v, out, **kwargs)
        with pytest.raises(want.type) as got:
            pp.fast_postprocess_video(proc, v, out, **kwargs)
        assert str(got.value) == str(want.value)
    else:
        got, ref = pp.fast_postprocess_video(proc, v, out, **kwargs), original(proc, v, out, **kwargs)
        if out in ("pt", "latent"):
            assert torch.equal(got, ref)
        else:
            assert same(got, ref)
    assert pp.STATS.fast == 0 and sum(pp.STATS.fallback.values()) == 1


def test_cpu_tensor_without_emulation_is_refused():
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.bfloat16)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v))
    assert pp.STATS.fast == 0 and pp.STATS.fallback == {"cpu tensor": 1}


def test_env_switch(emulated, monkeypatch):
    monkeypatch.setenv("DIFFUSERS_FASTPATH_DISABLE", "1")
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.bfloat16)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v)) and pp.STATS.fast == 0


def test_first_call_check_catches_a_broken_copy(emulated, monkeypatch, fastpath_log):
    """A copy that corrupts one value: the first call's check warns once, disables the fast path, and that call and
    every later one return diffusers' result."""
    corrupt_copies(monkeypatch)
    proc = VideoProcessor()
    for seed in range(3):
        v = video((2, 3, 3, 4, 6), torch.bfloat16, seed=seed, specials=False)
        assert same(pp.fast_postprocess_video(proc, v, _chunk_bytes=10), original(proc, v))
    warnings = [r for r in fastpath_log.records if "video post-processing is off" in r.getMessage()]
    assert len(warnings) == 1 and pp._disabled
    assert pp.STATS.fast == 0 and sum(pp.STATS.fallback.values()) == 3


def test_an_exception_falls_back_and_disables(emulated, monkeypatch, fastpath_log):
    raising_copies(monkeypatch, "boom")
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.float32)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v))
    assert pp._disabled and any("boom" in r.getMessage() for r in fastpath_log.records)
    lock = next(iter(pp._buffers.values()))[0]
    assert not lock.locked()  # (the buffers are free for the next call)


def test_a_guard_that_raises_refuses(emulated, monkeypatch):
    def raising(video):
        raise RuntimeError("guard bug")

    monkeypatch.setattr(pp, "_device_ok", raising)
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.bfloat16)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v))
    assert pp.STATS.fallback == {"guard error": 1}


def test_buffers_are_small_and_reused(emulated):
    proc = VideoProcessor()
    for seed in range(3):
        pp.fast_postprocess_video(proc, video((2, 3, 3, 4, 6), torch.bfloat16, seed=seed), _chunk_bytes=10)
    keys = [k for k in pp._buffers if k[1] == torch.bfloat16 and k[2] == 5]
    assert len(keys) == 1
    _, a, b = pp._buffers[keys[0]]
    assert a.numel() == b.numel() == 5


def tiny_ltx_pipeline():
    from diffusers_fastpath.testing import build_ltx_transformer, ltx_pipeline

    return ltx_pipeline(build_ltx_transformer(seed=1))


def test_patch_installs_once_and_unpatch_removes(emulated):
    pipe = tiny_ltx_pipeline()
    proc = pipe.video_processor
    assert type(proc) is VideoProcessor and "postprocess_video" not in vars(proc)
    fp.patch(pipe)
    installed = vars(proc)["postprocess_video"]
    assert isinstance(installed, functools.partial) and installed.func is pp.fast_postprocess_video
    fp.patch(pipe)  # twice: not wrapped again
    assert vars(proc)["postprocess_video"] is installed
    v = video((1, 3, 2, 4, 6), torch.bfloat16)
    assert same(proc.postprocess_video(v, output_type="np"), original(proc, v)) and pp.STATS.fast == 1
    assert "video post-processing" in str(fp.report(pipe))
    copied = copy.deepcopy(proc)  # the processor stays an ordinary object: it copies and pickles with its wrapper
    assert same(copied.postprocess_video(v), original(proc, v)) and pp.installed(copied)
    assert pp.installed(pickle.loads(pickle.dumps(proc)))
    fp.unpatch(pipe)
    assert "postprocess_video" not in vars(proc)
    assert same(proc.postprocess_video(v), original(proc, v)) and pp.STATS.fast == 2  # diffusers' own now


def test_patch_leaves_a_processor_method_of_its_own():
    pipe = tiny_ltx_pipeline()
    mine = functools.partial(VideoProcessor.postprocess_video, pipe.video_processor)
    pipe.video_processor.postprocess_video = mine
    fp.patch(pipe)
    assert vars(pipe.video_processor)["postprocess_video"] is mine
    fp.unpatch(pipe)
    assert vars(pipe.video_processor)["postprocess_video"] is mine


def test_patch_leaves_a_subclass_that_overrides():
    pipe = tiny_ltx_pipeline()
    pipe.video_processor = OwnPostprocess()
    fp.patch(pipe)
    assert "postprocess_video" not in vars(pipe.video_processor)
    fp.unpatch(pipe)


def test_a_model_patched_alone_is_unaffected():
    pipe = tiny_ltx_pipeline()
    fp.patch(pipe.transformer)
    assert "postprocess_video" not in vars(pipe.video_processor)
    fp.unpatch(pipe.transformer)


# ---- output_type="pil" ------------------------------------------------------------------------------------------


def same_pil(got, ref) -> bool:
    """diffusers' "pil" result: a list per batch element of lists of images, each of the same type, mode, size,
    bytes and read-only flag (PIL maps modes "L" and "RGBA" onto the array)."""
    assert type(ref) is list and all(type(r) is list for r in ref)
    return (type(got) is list and len(got) == len(ref) and all(
        type(g) is list and len(g) == len(r) and all(
            type(a) is type(b) and a.mode == b.mode and a.size == b.size and a.readonly == b.readonly
            and a.tobytes() == b.tobytes() for a, b in zip(g, r))
        for g, r in zip(got, ref)))


PIL_SHAPES = [(1, 3, 1, 4, 6), (1, 3, 3, 4, 6), (2, 3, 1, 5, 7), (2, 3, 3, 5, 7), (2, 1, 3, 4, 6), (1, 1, 2, 1, 5),
              (2, 4, 2, 3, 3), (1, 2, 2, 3, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", PIL_SHAPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [7, 1 << 20])
def test_emulated_pil_equals_diffusers(emulated, dtype, shape, chunk_bytes):
    """B 1 and 2, T 1 and 3, RGB, one channel (mode "L", squeezed as diffusers squeezes it: a width or height of 1
    too), RGBA, LA, inf (clamped to 1): diffusers' images, to the byte; verified, then fast."""
    proc = VideoProcessor()
    for seed in range(2):
        v = video(shape, dtype, seed=seed, specials=False)
        v.view(-1)[0] = float("inf")
        v.view(-1)[-1] = -float("inf")
        got = pp.fast_postprocess_video(proc, v, "pil", _chunk_bytes=chunk_bytes)
        assert same_pil(got, original(proc, v, "pil"))
    assert pp.STATS.fast == 2 and not pp.STATS.fallback and not pp._disabled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_emulated_pil_every_boundary(emulated, dtype):
    """Values after the denormalize at 0, 1, every bf16 / fp16 value in [0, 1], and (fp32) the floats around each
    (k + 0.5) / 255 of which *255 gives an exact .5 (rounded half to even by numpy and by torch): the same bytes."""
    if dtype == torch.float32:
        k = torch.arange(255, dtype=torch.float64)
        mid = ((k + 0.5) / 255).float()
        bits = mid.view(torch.int32)
        x = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)] + [torch.tensor([0.0, 1.0, 0.5])])
    else:
        bits = torch.arange(0, 1 << 15, dtype=torch.int16)
        x = bits.view(dtype)
        x = x[(x >= 0) & (x <= 1)].float()
    x = x.clamp(0.5, 1)  # [0.5, 1]: v = 2x - 1 exact, and diffusers' (v * 0.5 + 0.5) gives x back exactly
    lo = torch.cat([x, torch.tensor([0.0, 1.0])]) if dtype != torch.float32 else x
    v = (2 * lo.double() - 1).to(dtype)
    # and [0, 0.5): v = 2x - 1 may round; whatever the denormalize gives is what both sides convert
    small = (2 * torch.linspace(0, 0.5, 3001, dtype=torch.float64) - 1).to(dtype)
    v = torch.cat([v, small, torch.tensor([-1.0, 1.0, -0.0, 0.0, -2.0, 2.0], dtype=dtype)])
    n = (v.numel() + 11) // 12 * 12
    v = torch.cat([v, v[: n - v.numel()]]).reshape(1, 3, 1, 2, n // 6)
    proc = VideoProcessor()
    after = proc.denormalize(v).float().numpy() * 255
    if dtype == torch.float32:  # the test reaches exact ties
        assert int((after - np.floor(after) == 0.5).sum()) > 100
    assert (after == 0).any() and (after == 255).any()
    got = pp.fast_postprocess_video(proc, v, "pil")
    assert same_pil(got, original(proc, v, "pil")) and pp.STATS.fast == 1


def test_to_uint8_is_numpys_conversion():
    """The device conversion against numpy_to_pil's expression on the same float32 values, -0.0, 0, 1 and ties
    included (values in [0, 1] only: what the fast path lets through)."""
    k = torch.arange(255, dtype=torch.float64)
    mid = ((k + 0.5) / 255).float().view(torch.int32)
    x = torch.cat([(mid + d).view(torch.float32) for d in (-1, 0, 1)]
                  + [torch.tensor([-0.0, 0.0, 1.0, 0.5, 1e-30, 1 - 2 ** -24])])
    want = (x.numpy() * 255).round().astype("uint8")
    assert (x.numpy() * 255).dtype == np.float32
    assert int(((x.numpy() * 255) % 1 == 0.5).sum()) > 50
    frames = x.reshape(1, 1, 1, -1)  # [T, C, H, W]
    got = pp._to_uint8(frames)
    assert got.dtype == torch.uint8 and got.shape == (1, 1, x.numel(), 1) and got.is_contiguous()
    assert got.view(-1).numpy().tobytes() == want.tobytes()


def test_pil_frames_diffusers_cannot_make(emulated):
    """One channel of 1 x 1: numpy_to_pil's squeeze leaves a 0-D array that Image.fromarray refuses. The call raises
    diffusers' own error (the original runs), and the fast path stays on."""
    proc, v = VideoProcessor(), video((1, 1, 2, 1, 1), torch.float32, specials=False)
    with pytest.raises(Exception) as want:
        original(proc, v, "pil")
    with pytest.raises(want.type) as got:
        pp.fast_postprocess_video(proc, v, "pil")
    assert str(got.value) == str(want.value)
    assert pp.STATS.fallback == {pp.REASON_PIL: 1} and not pp._disabled


def test_pil_conversion_in_pieces(emulated, monkeypatch):
    """Frames converted a few at a time (a small float32 temporary): the same images."""
    monkeypatch.setattr(pp, "_CONVERT_BYTES", 4 * 3 * 4 * 6 * 2)  # two frames at a time
    proc, v = VideoProcessor(), video((2, 3, 5, 4, 6), torch.bfloat16, specials=False)
    assert same_pil(pp.fast_postprocess_video(proc, v, "pil", _chunk_bytes=5), original(proc, v, "pil"))
    assert pp.STATS.fast == 1


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_pil_images_own_their_memory(emulated, channels):
    """PIL maps modes "L" and "RGBA" onto the array: a later call (the same pinned buffers) leaves the images of
    an earlier one as they were."""
    proc = VideoProcessor()
    v0, v1 = (video((1, channels, 2, 4, 6), torch.float32, seed=s, specials=False) for s in (0, 1))
    first = pp.fast_postprocess_video(proc, v0, "pil", _chunk_bytes=8)
    before = [im.tobytes() for im in first[0]]
    pp.fast_postprocess_video(proc, v1, "pil", _chunk_bytes=8)
    assert [im.tobytes() for im in first[0]] == before
    assert same_pil(first, original(proc, v0, "pil"))


@pytest.mark.parametrize("case", ["nan", "nan_second", "no_normalize", "kwargs", "numpy_to_pil", "instance"])
def test_pil_refusals_return_the_original(emulated, case):
    proc, kwargs = VideoProcessor(), {}
    v = video((2, 3, 2, 4, 6), torch.float32, specials=False)
    reason = None
    if case == "nan":
        v.view(-1)[3] = float("nan")
        reason = pp.REASON_RANGE
    elif case == "nan_second":  # the second batch element: found after the first was converted
        v[1].view(-1)[7] = float("nan")
        reason = pp.REASON_RANGE
    elif case == "no_normalize":
        proc = VideoProcessor(do_normalize=False)
        reason = pp.REASON_NO_CLAMP
    elif case == "kwargs":
        kwargs = {"do_denormalize": [True, True]}
        reason = "keyword arguments"
    elif case == "numpy_to_pil":
        class OwnNumpyToPil(VideoProcessor):
            @staticmethod
            def numpy_to_pil(images):
                return VideoProcessor.numpy_to_pil(images)

        proc = OwnNumpyToPil()
        reason = "OwnNumpyToPil.numpy_to_pil overridden"
    elif case == "instance":
        proc.numpy_to_pil = VideoProcessor.numpy_to_pil
        reason = "numpy_to_pil replaced on the instance"
    got = pp.fast_postprocess_video(proc, v, "pil", **kwargs)
    assert same_pil(got, original(proc, v, "pil", **kwargs))
    assert pp.STATS.fast == 0 and pp.STATS.fallback == {reason: 1} and not pp._disabled
    if case in ("numpy_to_pil", "instance"):  # "np" does not use it: still taken
        assert same(pp.fast_postprocess_video(proc, v), original(proc, v)) and pp.STATS.fast == 1


def test_pil_first_call_check_catches_a_broken_conversion(emulated, monkeypatch, fastpath_log):
    """A device conversion off by one in one byte: the first call's check warns once, disables the fast path (both
    types), and that call and every later one return diffusers' images."""
    corrupt_conversion(monkeypatch)
    proc = VideoProcessor()
    for seed in range(3):
        v = video((2, 3, 3, 4, 6), torch.bfloat16, seed=seed, specials=False)
        assert same_pil(pp.fast_postprocess_video(proc, v, "pil", _chunk_bytes=10), original(proc, v, "pil"))
    warnings = [r for r in fastpath_log.records if "video post-processing is off" in r.getMessage()]
    assert len(warnings) == 1 and pp._disabled
    assert pp.STATS.fast == 0 and pp.STATS.fallback == {pp.REASON_DISABLED: 3}
    v = video((1, 3, 2, 4, 6), torch.bfloat16, specials=False)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v)) and pp.STATS.fast == 0


def test_pil_an_exception_falls_back_and_disables(emulated, monkeypatch, fastpath_log):
    raising_copies(monkeypatch, "pil boom")
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.float16, specials=False)
    assert same_pil(pp.fast_postprocess_video(proc, v, "pil"), original(proc, v, "pil"))
    assert pp._disabled and any("pil boom" in r.getMessage() for r in fastpath_log.records)
    assert all(not entry[0].locked() for entry in pp._buffers.values())


def test_pil_and_np_signatures_are_checked_apart(emulated):
    """The same video as "np" and as "pil": each output type's first call is checked against diffusers'."""
    proc, v = VideoProcessor(), video((1, 3, 2, 4, 6), torch.bfloat16, specials=False)
    assert same(pp.fast_postprocess_video(proc, v), original(proc, v))
    assert same_pil(pp.fast_postprocess_video(proc, v, "pil"), original(proc, v, "pil"))
    assert len(pp._verified) == 2 and {k[1] for k in pp._verified} == {"np", "pil"}


def test_patched_pipeline_pil(emulated):
    pipe = tiny_ltx_pipeline()
    fp.patch(pipe)
    v = video((1, 3, 2, 4, 6), torch.bfloat16, specials=False)
    assert same_pil(pipe.video_processor.postprocess_video(v, output_type="pil"),
                    original(pipe.video_processor, v, "pil"))
    assert pp.STATS.fast == 1
    fp.unpatch(pipe)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def matches(got, ref, output_type) -> bool:
    return same_pil(got, ref) if output_type == "pil" else same(got, ref)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("output_type", ["np", "pil"])
def test_gpu_ltx_size_bf16(output_type):
    """LTX-Video's 121 x 512 x 768 in bf16: diffusers' array (with NaN, inf and a NaN payload) or diffusers' 121
    images (without NaN: "pil" refuses it), verified, then fast."""
    proc = VideoProcessor()
    v = video((1, 3, 121, 512, 768), torch.bfloat16, specials=output_type == "np", device="cuda")
    ref = original(proc, v, output_type)
    got = pp.fast_postprocess_video(proc, v, output_type)
    assert matches(got, ref, output_type) and pp.STATS.fast == 1 and not pp._disabled
    assert matches(pp.fast_postprocess_video(proc, v, output_type), ref, output_type) and pp.STATS.fast == 2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("output_type", ["np", "pil"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("chunk_bytes", [1000, pp.CHUNK_BYTES])
def test_gpu_small_odd_shape(output_type, dtype, chunk_bytes):
    """B = 2, odd sizes, inf; "np" in fp32 with NaN and a NaN payload too."""
    proc = VideoProcessor()
    v = video((2, 3, 7, 37, 53), dtype, specials=output_type == "np" and dtype == torch.float32, device="cuda")
    v.view(-1)[6], v.view(-1)[-3] = float("inf"), -float("inf")
    got = pp.fast_postprocess_video(proc, v, output_type, _chunk_bytes=chunk_bytes)
    assert matches(got, original(proc, v, output_type), output_type) and pp.STATS.fast == 1 and not pp._disabled


@pytest.mark.gpu
@cuda
def test_gpu_pil_nan_is_refused():
    """A NaN on the device: aminmax finds it, diffusers' original runs (no disabling)."""
    proc = VideoProcessor()
    v = video((2, 3, 7, 37, 53), torch.float32, device="cuda")  # NaN, inf, a NaN payload
    assert same_pil(pp.fast_postprocess_video(proc, v, "pil"), original(proc, v, "pil"))
    assert pp.STATS.fast == 0 and pp.STATS.fallback == {pp.REASON_RANGE: 1} and not pp._disabled


# ---- images: image_processor.postprocess (FLUX, Qwen-Image, Z-Image, ...) ------------------------------------------


def image_original(processor, image, output_type="pil", *args, **kwargs):
    return VaeImageProcessor.postprocess(processor, image, output_type, *args, **kwargs)


def same_images(got, ref) -> bool:
    return same_pil([got], [ref])


def image_matches(got, ref, output_type) -> bool:
    return same_images(got, ref) if output_type == "pil" else same(got, ref)


IMAGE_SHAPES = [(1, 3, 4, 6), (2, 3, 5, 7), (1, 1, 3, 5), (2, 1, 4, 6), (1, 3, 1, 5), (2, 3, 1, 1), (1, 4, 3, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", IMAGE_SHAPES, ids=str)
@pytest.mark.parametrize("output_type", ["pil", "np"])
@pytest.mark.parametrize("chunk_bytes", [7, 1 << 20])
def test_emulated_image_equals_diffusers(emulated, dtype, shape, output_type, chunk_bytes):
    """B 1 and 2, odd H / W, RGB, one channel (mode "L"), RGBA, a height or width of 1, inf (clamped): diffusers'
    images to the byte (mode, size, read-only flag) or its array (shape, dtype, strides, bytes); verified, then fast."""
    proc = VaeImageProcessor()
    for seed in range(2):
        x = video(shape, dtype, seed=seed, specials=False)
        x.view(-1)[0], x.view(-1)[-1] = float("inf"), -float("inf")
        got = pp.fast_postprocess_image(proc, x, output_type, _chunk_bytes=chunk_bytes)
        assert image_matches(got, image_original(proc, x, output_type), output_type)
    assert pp.STATS.fast == 2 and not pp.STATS.fallback and not pp._disabled


@pytest.mark.parametrize("shape", [(1, 3, 4, 6), (2, 1, 1, 5)], ids=str)
def test_emulated_image_np_nan_and_no_normalize(emulated, shape):
    """"np" copies whatever the denormalize gives: NaN with payloads, and a processor without do_normalize."""
    for normalize in (True, False):
        proc, x = VaeImageProcessor(do_normalize=normalize), video(shape, torch.float32)
        assert same(pp.fast_postprocess_image(proc, x, "np", _chunk_bytes=12), image_original(proc, x, "np"))
    assert pp.STATS.fast == 2 and not pp._disabled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_emulated_image_pil_ties(emulated, dtype):
    """Every bf16 / fp16 value of [0.5, 1] after the denormalize, and fp32's exact .5 ties after *255 (numpy and
    torch both round half to even), 0 and 1: the same bytes."""
    if dtype == torch.float32:
        mid = ((torch.arange(255, dtype=torch.float64) + 0.5) / 255).float().view(torch.int32)
        x = torch.cat([(mid + d).view(torch.float32) for d in range(-2, 3)] + [torch.tensor([0.5, 1.0])])
    else:
        x = torch.arange(0, 1 << 15, dtype=torch.int16).view(dtype)
        x = x[(x >= 0.5) & (x <= 1)].float()
    v = torch.cat([(2 * x.double() - 1).to(dtype), torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=dtype)])
    n = (v.numel() + 5) // 6 * 6
    v = torch.cat([v, v[: n - v.numel()]]).reshape(1, 3, 2, n // 6)
    proc = VaeImageProcessor()
    if dtype == torch.float32:
        after = proc.denormalize(v).numpy() * 255
        assert int((after - np.floor(after) == 0.5).sum()) > 100
    assert same_images(pp.fast_postprocess_image(proc, v), image_original(proc, v)) and pp.STATS.fast == 1


class OwnImagePostprocess(VaeImageProcessor):
    def postprocess(self, image, output_type="pil", do_denormalize=None):
        return super().postprocess(image, output_type, do_denormalize)


class OwnImageNumpyToPil(VaeImageProcessor):
    @staticmethod
    def numpy_to_pil(images):
        return VaeImageProcessor.numpy_to_pil(images)


@pytest.mark.parametrize("case", ["nan", "do_denormalize", "positional", "pt", "latent", "subclass", "numpy_to_pil",
                                  "ldm3d", "instance", "no_normalize", "noncontiguous", "3d", "cpu"])
def test_image_refusals_return_the_original(emulated, monkeypatch, case):
    from diffusers.image_processor import VaeImageProcessorLDM3D

    proc, out, args, kwargs = VaeImageProcessor(), "pil", (), {}
    x = video((2, 3, 4, 6), torch.float32, specials=False)
    if case == "nan":
        x.view(-1)[5] = float("nan")
    elif case == "do_denormalize":
        kwargs = {"do_denormalize": [True, True]}
    elif case == "positional":
        args = ([True, False],)
    elif case in ("pt", "latent"):
        out = case
    elif case == "subclass":
        proc = OwnImagePostprocess()
    elif case == "numpy_to_pil":
        proc = OwnImageNumpyToPil()
    elif case == "ldm3d":  # "np": RGB and depth, a tuple of two arrays ("pil" fails in this Pillow either way)
        proc, x, out = VaeImageProcessorLDM3D(), video((2, 4, 4, 6), torch.float32, specials=False), "np"
    elif case == "instance":
        proc.numpy_to_pil = VaeImageProcessor.numpy_to_pil
    elif case == "no_normalize":
        proc = VaeImageProcessor(do_normalize=False)
        x = x.clamp(0, 1)
    elif case == "noncontiguous":
        x = x.transpose(2, 3)
    elif case == "3d":
        x = x[0]
    elif case == "cpu":
        monkeypatch.setattr(pp, "_device_ok", lambda t: t.is_cuda)
    if case == "3d":  # diffusers' own error, raised by diffusers' own code
        with pytest.raises(Exception) as want:
            image_original(proc, x, out)
        with pytest.raises(want.type) as got:
            pp.fast_postprocess_image(proc, x, out)
        assert str(got.value) == str(want.value) and pp.STATS.fallback == {"3-D image": 1}
        return
    got = pp.fast_postprocess_image(proc, x, out, *args, **kwargs)
    ref = type(proc).postprocess(proc, x, out, *args, **kwargs)
    if out in ("pt", "latent"):
        assert torch.equal(got, ref)
    elif case == "ldm3d":
        assert type(got) is tuple and len(got) == 2 and all(same(g, r) for g, r in zip(got, ref))
    else:
        assert same_images(got, ref)
    assert pp.STATS.fast == 0 and sum(pp.STATS.fallback.values()) == 1 and not pp._disabled
    if case in ("numpy_to_pil", "instance"):  # "np" does not use it: still taken
        assert same(pp.fast_postprocess_image(proc, x, "np"), image_original(proc, x, "np")) and pp.STATS.fast == 1


@pytest.mark.parametrize("output_type", ["pil", "np"])
def test_image_first_call_check_catches_a_broken_conversion(emulated, monkeypatch, fastpath_log, output_type):
    """A corrupted byte (pil: the device conversion; np: the copy): the first call's check warns once, disables the
    fast path (images and videos), and every call returns diffusers' result."""
    (corrupt_conversion if output_type == "pil" else corrupt_copies)(monkeypatch)
    proc = VaeImageProcessor()
    for seed in range(3):
        x = video((2, 3, 4, 6), torch.bfloat16, seed=seed, specials=False)
        assert image_matches(pp.fast_postprocess_image(proc, x, output_type), image_original(proc, x, output_type),
                             output_type)
    warnings = [r for r in fastpath_log.records if "post-processing is off" in r.getMessage()]
    assert len(warnings) == 1 and pp._disabled
    assert pp.STATS.fast == 0 and pp.STATS.fallback == {pp.REASON_DISABLED: 3}
    v = video((1, 3, 2, 4, 6), torch.bfloat16, specials=False)
    assert same(pp.fast_postprocess_video(VideoProcessor(), v), original(VideoProcessor(), v)) and pp.STATS.fast == 0


def test_image_pil_one_by_one_gray_raises_diffusers_error(emulated):
    proc, x = VaeImageProcessor(), video((1, 1, 1, 1), torch.float32, specials=False)
    with pytest.raises(Exception) as want:
        image_original(proc, x)
    with pytest.raises(want.type) as got:
        pp.fast_postprocess_image(proc, x)
    assert str(got.value) == str(want.value) and not pp._disabled


def tiny_flux():
    from diffusers_fastpath.testing import tiny_flux_pipeline

    return tiny_flux_pipeline(dtype=torch.float32, seed=3)


def test_image_patch_installs_once_and_unpatch_removes(emulated):
    pipe = tiny_flux()
    proc = pipe.image_processor
    assert type(proc) is VaeImageProcessor and "postprocess" not in vars(proc)
    assert pp.install(pipe) and pp.installed_on(pipe)
    mine = vars(proc)["postprocess"]
    assert isinstance(mine, functools.partial) and mine.func is pp.fast_postprocess_image
    assert pp.install(pipe) and vars(proc)["postprocess"] is mine  # twice: not wrapped again
    x = video((1, 3, 4, 6), torch.bfloat16, specials=False)
    assert same_images(proc.postprocess(x, output_type="pil"), image_original(proc, x)) and pp.STATS.fast == 1
    assert pp.installed(pickle.loads(pickle.dumps(proc))) and pp.installed(copy.deepcopy(proc))
    pp.uninstall(pipe)
    assert "postprocess" not in vars(proc) and not pp.installed_on(pipe)


def test_image_install_leaves_others():
    from diffusers.image_processor import PixArtImageProcessor, VaeImageProcessorLDM3D

    pipe = tiny_flux()
    pipe.image_processor = VaeImageProcessorLDM3D()  # overrides numpy_to_pil and postprocess
    assert not pp.install(pipe) and "postprocess" not in vars(pipe.image_processor)
    pipe.image_processor = PixArtImageProcessor()  # a subclass keeping every method involved: taken
    assert pp.install(pipe) and pp.installed(pipe.image_processor)
    pp.uninstall(pipe)
    pipe.image_processor = VaeImageProcessor()
    own = functools.partial(VaeImageProcessor.postprocess, pipe.image_processor)
    pipe.image_processor.postprocess = own
    assert not pp.install(pipe) and vars(pipe.image_processor)["postprocess"] is own
    pp.uninstall(pipe)
    assert vars(pipe.image_processor)["postprocess"] is own


@pytest.mark.parametrize("output_type", ["pil", "np"])
def test_tiny_flux_pipeline_identical_patched(emulated, output_type):
    """A real tiny FLUX pipeline (CPU, float32): patched (models and post-processing) gives the same images or array
    as unpatched, the post-processing taken fast."""
    from diffusers_fastpath.testing import prompt_embeddings

    pipe = tiny_flux()
    embeds = prompt_embeddings(pipe)

    def run():
        return pipe(**embeds, height=32, width=48, num_inference_steps=2, guidance_scale=3.5,
                    generator=torch.Generator().manual_seed(0), output_type=output_type).images

    ref = run()
    fp.patch(pipe)
    try:
        assert pp.installed(pipe.image_processor)
        got = run()
        assert "post-processing" in str(fp.report(pipe))
    finally:
        fp.unpatch(pipe)
    assert not pp.installed_on(pipe)
    assert image_matches(got, ref, output_type) and pp.STATS.fast == 1, pp.STATS.fallback


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("output_type", ["pil", "np"])
def test_gpu_image_1024_bf16(output_type):
    """FLUX's 1024 x 1024 image in bf16: diffusers' image or array (np: with NaN, inf and a NaN payload), verified,
    then fast."""
    proc = VaeImageProcessor()
    x = video((1, 3, 1024, 1024), torch.bfloat16, specials=output_type == "np", device="cuda")
    ref = image_original(proc, x, output_type)
    assert image_matches(pp.fast_postprocess_image(proc, x, output_type), ref, output_type)
    assert image_matches(pp.fast_postprocess_image(proc, x, output_type), ref, output_type)
    assert pp.STATS.fast == 2 and not pp._disabled


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("output_type", ["pil", "np"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("chunk_bytes", [1000, pp.CHUNK_BYTES])
def test_gpu_image_small_odd_shape(output_type, dtype, chunk_bytes):
    proc = VaeImageProcessor()
    x = video((2, 3, 37, 53), dtype, specials=False, device="cuda")
    x.view(-1)[6], x.view(-1)[-3] = float("inf"), -float("inf")
    got = pp.fast_postprocess_image(proc, x, output_type, _chunk_bytes=chunk_bytes)
    assert image_matches(got, image_original(proc, x, output_type), output_type)
    assert pp.STATS.fast == 1 and not pp._disabled
