"""A video pipeline's last step, ``video_processor.postprocess_video(video, output_type="np")``, with the same result
in a tenth of the time.

Why: diffusers' `VideoProcessor.postprocess_video` runs, per batch element, the processor's ``postprocess`` (the
denormalize ``(x * 0.5 + 0.5).clamp(0, 1)`` on the GPU, then ``pt_to_numpy``: ``.cpu()``, a pageable device-to-host
copy, and a CPU ``permute(0, 2, 3, 1).float().numpy()``), then ``np.stack`` of the elements (a strided copy of the
whole float32 video). For LTX-Video distilled at 121 x 512 x 768 in bf16 on an H100 host that is about 360 ms of a
1.07 s patched generation: the pageable copy of 285 MB ~155 ms, the conversion 27-58 ms, ``np.stack`` ~150 ms.

What: `fast_postprocess_video` runs diffusers' own denormalize (``processor.postprocess(frames, "pt")``, exactly
what the original runs on the GPU), then copies each element's frames to the host in chunks (`CHUNK_BYTES`) through
two small reused pinned buffers (a ``non_blocking`` copy and a CUDA event per chunk: while chunk k travels, the CPU
converts chunk k-1 with one ``copy_`` into the float32 result, allocated once), which is the one conversion
``.float()`` makes, value for value. The result is the array diffusers returns: the same shape, dtype, values (bit
for bit, NaN payloads included) and strides. Its memory order is diffusers': a contiguous ``[B, C, T, H, W]`` video
gives a ``(B, T, H, W, C)`` array laid out as ``[B][C][T][H][W]``; the strides of its size-1 dimensions (which
``np.stack`` and torch choose by rules of their own) are read from diffusers itself, by running the original on a
tiny CPU tensor of the same pattern of sizes (at most 32 elements) on every call.

When: `fast_postprocess_video` takes a call only where ``output_type == "np"`` with no other argument, the video is a
contiguous 5-D CUDA tensor of bf16, fp16 or fp32 with elements and no autograd history, and the processor runs
diffusers' own ``postprocess_video``, ``postprocess``, ``pt_to_numpy``, ``denormalize`` and
``_denormalize_conditionally`` (none replaced on its class or on the instance); anything else, and any exception on
the way (a guard never raises), runs diffusers' original and returns its result. The first call of each signature
(device, dtype, shape, processor class) also runs the original and compares shape, dtype, strides and bytes; a
mismatch, or an exception, warns once and sends every later call to the original for the process.
``DIFFUSERS_FASTPATH_DISABLE=1`` sends every call to the original too. `STATS` counts fast calls and fallbacks by
reason (process-wide; `report` shows them for a pipeline it is installed on).

Where: `install` sets it as the ``postprocess_video`` instance attribute of a pipeline's ``video_processor`` (a
``functools.partial`` of this function and the processor, which copies and pickles with it); `patch` installs it,
`unpatch` removes it (only this one).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from ._logging import logger, warn_once
from .ops._policy import Site, _env_disabled

CHUNK_BYTES = 16 << 20  # bytes of the video's dtype per pinned chunk (two such buffers per device, dtype and size)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the processor methods the fast path stands for (diffusers' own, neither on the class nor on the instance replaced)
_METHODS = ("postprocess_video", "postprocess", "pt_to_numpy", "denormalize", "_denormalize_conditionally")

STATS = Site("postprocess_video")  # fast calls and fallbacks by reason, process-wide
_verified: set = set()  # signatures whose first fast call matched the original (shape, dtype, strides, bytes)
_disabled: list[str] = []  # why the fast path is off for this process (empty: it is on)
_buffers: dict[tuple, tuple[threading.Lock, torch.Tensor, torch.Tensor]] = {}
_buffers_lock = threading.Lock()

REASON_ENV = "DIFFUSERS_FASTPATH_DISABLE is set"
REASON_DISABLED = "disabled after a mismatch or an error"
REASON_LAYOUT = "diffusers' result is not laid out as [B][C][T][H][W]"
REASON_BUSY = "pinned buffers in use by another thread"


def _original(processor: Any, video: Any, output_type: str, kwargs: dict) -> Any:
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor.postprocess_video(processor, video, output_type, **kwargs)


def _device_ok(video: torch.Tensor) -> bool:
    """Whether the video is where the pinned copy serves (a CUDA device). The tests replace it to run the same
    chunked, double-buffered copy on a CPU tensor."""
    return video.is_cuda


def _copy_async(dst: torch.Tensor, src: torch.Tensor) -> Any:
    """Start copying `src` (on the video's device) into `dst` (a pinned host buffer); returns what `_wait` waits on.
    From a CUDA tensor: a ``non_blocking`` copy on the current stream and an event recorded after it."""
    if src.is_cuda:
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src.device))  # (the copy's stream: the current one of src's device)
        return event
    dst.copy_(src)
    return None


def _wait(token: Any) -> None:
    if token is not None:
        token.synchronize()


def _pinned(device: torch.device, dtype: torch.dtype, n: int) -> tuple[threading.Lock, torch.Tensor, torch.Tensor]:
    """Two host buffers of `n` elements of `dtype` (pinned for a CUDA device), made once per (device, dtype, n) and
    reused, with the lock that one call holds while it uses them."""
    key = (str(device), dtype, n)
    with _buffers_lock:
        entry = _buffers.get(key)
        if entry is None:
            pin = device.type == "cuda"
            entry = (threading.Lock(), torch.empty(n, dtype=dtype, pin_memory=pin),
                     torch.empty(n, dtype=dtype, pin_memory=pin))
            _buffers[key] = entry
    return entry


def _refusal(processor: Any, video: Any, output_type: str, kwargs: dict) -> str | None:
    """Why the fast path does not take this call, or None. Attribute reads only; never raises (the caller catches)."""
    from diffusers.video_processor import VideoProcessor

    if _env_disabled():
        return REASON_ENV
    if _disabled:
        return REASON_DISABLED
    if output_type != "np":
        return f"output_type={output_type!r}"
    if kwargs:
        return "keyword arguments"
    if not isinstance(video, torch.Tensor):
        return "not a tensor"
    if not _device_ok(video):
        return f"{video.device.type} tensor"
    if video.dim() != 5:
        return f"{video.dim()}-D video"
    if video.dtype not in _DTYPES:
        return f"{video.dtype}"
    if video.numel() == 0:
        return "no elements"
    if not video.is_contiguous():
        return "non-contiguous video"
    if video.requires_grad and torch.is_grad_enabled():
        return "requires grad"
    cls = type(processor)
    if not isinstance(processor, VideoProcessor):
        return f"{cls.__name__} is not a VideoProcessor"
    own = getattr(processor, "__dict__", {})
    for name in _METHODS:
        if getattr(cls, name) is not getattr(VideoProcessor, name):
            return f"{cls.__name__}.{name} overridden"
        if name != "postprocess_video" and name in own:
            return f"{name} replaced on the instance"
    return None


def _strides(processor: Any, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...] | None:
    """The strides (bytes) of diffusers' result for a contiguous video of `shape` and `dtype`, or None where its
    memory order is not ``[B][C][T][H][W]``. Read from the original's result on a CPU tensor of the same pattern of
    sizes (every size above 1 made 2): its dimensions of size 1 have the stride of the dimensions inside them (the
    product of their sizes), whatever rule picked their place; the others must have the strides of the float32
    ``[B, C, T, H, W]`` array transposed to ``(B, T, H, W, C)``."""
    proxy = tuple(1 if s == 1 else 2 for s in shape)
    got = _original(processor, torch.zeros(proxy, dtype=dtype), "np", {})
    B, C, T, H, W = shape
    out_shape = (B, T, H, W, C)
    if got.shape != tuple(1 if s == 1 else 2 for s in out_shape) or got.dtype != np.float32:
        return None
    item = 4
    mem = (C * T * H * W * item, T * H * W * item, H * W * item, W * item, item)  # [B, C, T, H, W], C order
    want = (mem[0], mem[2], mem[3], mem[4], mem[1])  # its transpose (0, 2, 3, 4, 1)
    big = [d for d in range(5) if out_shape[d] > 1]
    strides = []
    for d in range(5):
        s = got.strides[d]
        if out_shape[d] > 1:
            # the proxy's non-1 dimensions in the same order as ours: strides of 2 ** (number of them inside)
            inner = sum(1 for e in big if want[e] < want[d])
            if s != item << inner:
                return None
            strides.append(want[d])
        elif s == 0:
            strides.append(0)
        else:
            k, r = divmod(s, item)
            if r or k & (k - 1):  # not the product of some inner sizes: a layout this does not know
                return None
            inner = [e for e in big if got.strides[e] < s]
            if item << len(inner) != s:
                return None
            strides.append(item * int(np.prod([out_shape[e] for e in inner], dtype=np.int64)))
    return tuple(strides)


def _fast(processor: Any, video: torch.Tensor, chunk_bytes: int) -> np.ndarray | str:
    """The pinned, chunked copy: the result, or why it was not taken (a layout this does not reproduce)."""
    B, C, T, H, W = video.shape
    strides = _strides(processor, tuple(video.shape), video.dtype)
    if strides is None:
        return REASON_LAYOUT
    per = C * T * H * W
    mem = np.empty(B * per, np.float32)
    out = torch.from_numpy(mem)
    n = max(1, chunk_bytes // video.element_size())
    lock, *bufs = _pinned(video.device, video.dtype, n)
    if not lock.acquire(blocking=False):
        return REASON_BUSY
    tokens: list = []
    try:
        for b in range(B):
            pt = processor.postprocess(video[b].permute(1, 0, 2, 3), "pt")  # diffusers' own denormalize
            src = pt.permute(1, 0, 2, 3)
            if not src.is_contiguous() or src.dtype != video.dtype or src.device != video.device:
                return REASON_LAYOUT
            flat, dst = src.reshape(-1), out[b * per:(b + 1) * per]
            starts = range(0, per, n)
            tokens = [None] * len(starts)
            # double buffering: chunk k+1 travels into one buffer while the CPU converts chunk k out of the other
            # (whose previous chunk, k-1, was converted in the iteration before)
            tokens[0] = _copy_async(bufs[0][:min(n, per)], flat[:n])
            for k, s in enumerate(starts):
                e = min(s + n, per)
                if k + 1 < len(starts):
                    s1 = e
                    e1 = min(s1 + n, per)
                    tokens[k + 1] = _copy_async(bufs[(k + 1) % 2][:e1 - s1], flat[s1:e1])
                _wait(tokens[k])
                dst[s:e].copy_(bufs[k % 2][:e - s])
            tokens = []
            del pt, src, flat
    finally:
        for token in tokens:  # (an exception midway: no copy may still be writing a buffer the next call uses)
            _wait(token)
        lock.release()
    return np.ndarray((B, T, H, W, C), np.float32, buffer=mem, strides=strides)


def _same(got: np.ndarray, ref: Any) -> bool:
    return (isinstance(ref, np.ndarray) and got.shape == ref.shape and got.dtype == ref.dtype
            and got.strides == ref.strides and got.tobytes() == ref.tobytes())


def _disable(why: str) -> None:
    if not _disabled:
        _disabled.append(why)
    warn_once(f"diffusers_fastpath: the fast video post-processing is off for this process ({why}); "
              "postprocess_video runs as diffusers wrote it")


def fast_postprocess_video(processor: Any, video: Any, output_type: str = "np", *, _chunk_bytes: int | None = None,
                           **kwargs: Any) -> Any:
    """``processor.postprocess_video(video, output_type, **kwargs)`` as diffusers' `VideoProcessor` runs it, the
    same result; for ``output_type="np"`` of a contiguous CUDA video a pinned, chunked copy to the host instead of
    ``.cpu()``, ``.float()`` and ``np.stack`` (see the module's docstring). Anything it does not take runs
    diffusers' original."""
    try:
        reason = _refusal(processor, video, output_type, kwargs)
    except Exception as exc:  # noqa: BLE001 - a guard never raises: refuse, say so once
        warn_once(f"diffusers_fastpath: the video post-processing guard failed ({exc!r}); the original runs")
        reason = "guard error"
    if reason is None:
        key = (str(video.device), video.dtype, tuple(video.shape), type(processor))
        try:
            got = _fast(processor, video, CHUNK_BYTES if _chunk_bytes is None else _chunk_bytes)
        except Exception as exc:  # noqa: BLE001 - any failure: the original, once loudly, then off
            _disable(f"{type(exc).__name__}: {exc}")
            reason = REASON_DISABLED
        else:
            if isinstance(got, str):
                reason = got
            elif key in _verified:
                STATS.fast += 1
                return got
            else:
                ref = _original(processor, video, output_type, kwargs)
                if _same(got, ref):
                    _verified.add(key)
                    STATS.fast += 1
                    return got
                _disable(f"its first call of {key[:3]} differed from diffusers' result")
                STATS.fallback[REASON_DISABLED] += 1
                return ref
    STATS.fallback[reason] += 1
    return _original(processor, video, output_type, kwargs)


def installed(processor: Any) -> bool:
    """Whether `processor` has this package's ``postprocess_video`` on the instance."""
    fn = getattr(processor, "__dict__", {}).get("postprocess_video")
    return isinstance(fn, functools.partial) and fn.func is fast_postprocess_video and fn.args[:1] == (processor,)


def _eligible(processor: Any) -> bool:
    from diffusers.video_processor import VideoProcessor

    cls = type(processor)
    return isinstance(processor, VideoProcessor) and all(
        getattr(cls, name) is getattr(VideoProcessor, name) for name in _METHODS)


def install(pipe: Any) -> bool:
    """Set `fast_postprocess_video` as ``pipe.video_processor.postprocess_video`` where the pipeline holds diffusers'
    `VideoProcessor` (or a subclass that keeps its methods) without a ``postprocess_video`` of its own; True where
    it is there now (set now or before)."""
    processor = getattr(pipe, "video_processor", None)
    if processor is None or not _eligible(processor):
        return False
    if installed(processor):
        return True
    if "postprocess_video" in processor.__dict__:
        logger.info(f"diffusers_fastpath: {type(pipe).__name__}.video_processor has a postprocess_video of its own; "
                    "left as it is")
        return False
    processor.__dict__["postprocess_video"] = functools.partial(fast_postprocess_video, processor)
    logger.info(f"diffusers_fastpath: {type(pipe).__name__}.video_processor.postprocess_video takes the pinned copy "
                "for output_type='np'")
    return True


def uninstall(pipe: Any) -> None:
    """Remove what `install` set on ``pipe.video_processor`` (nothing else)."""
    processor = getattr(pipe, "video_processor", None)
    if processor is not None and installed(processor):
        del processor.__dict__["postprocess_video"]


def reset() -> None:
    """Forget the verified signatures, the disabling and the counters (tests)."""
    _verified.clear()
    _disabled.clear()
    STATS.reset()
