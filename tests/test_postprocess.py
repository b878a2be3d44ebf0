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
    real = pp._copy_async

    def corrupting(dst, src):
        token = real(dst, src)
        dst.view(-1)[-1] = 0.25
        return token

    monkeypatch.setattr(pp, "_copy_async", corrupting)
    proc = VideoProcessor()
    for seed in range(3):
        v = video((2, 3, 3, 4, 6), torch.bfloat16, seed=seed, specials=False)
        assert same(pp.fast_postprocess_video(proc, v, _chunk_bytes=10), original(proc, v))
    warnings = [r for r in fastpath_log.records if "video post-processing is off" in r.getMessage()]
    assert len(warnings) == 1 and pp._disabled
    assert pp.STATS.fast == 0 and sum(pp.STATS.fallback.values()) == 3


def test_an_exception_falls_back_and_disables(emulated, monkeypatch, fastpath_log):
    def broken(dst, src):
        raise RuntimeError("boom")

    monkeypatch.setattr(pp, "_copy_async", broken)
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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_gpu_ltx_size_bf16():
    """The pinned path at LTX-Video's 121 x 512 x 768 in bf16: diffusers' array, verified, then fast."""
    proc = VideoProcessor()
    v = video((1, 3, 121, 512, 768), torch.bfloat16, device="cuda")
    ref = original(proc, v)
    got = pp.fast_postprocess_video(proc, v)
    assert same(got, ref) and pp.STATS.fast == 1 and not pp._disabled
    assert same(pp.fast_postprocess_video(proc, v), ref) and pp.STATS.fast == 2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("chunk_bytes", [1000, pp.CHUNK_BYTES])
def test_gpu_small_odd_shape(dtype, chunk_bytes):
    proc = VideoProcessor()
    v = video((2, 3, 7, 37, 53), dtype, specials=dtype == torch.float32, device="cuda")
    got = pp.fast_postprocess_video(proc, v, _chunk_bytes=chunk_bytes)
    assert same(got, original(proc, v)) and pp.STATS.fast == 1 and not pp._disabled
