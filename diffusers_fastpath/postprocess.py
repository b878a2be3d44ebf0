"""A video pipeline's last step, ``video_processor.postprocess_video(video, output_type)``, and an image pipeline's,
``image_processor.postprocess(image, output_type)``, for ``"np"`` and ``"pil"``, with the same result in a fraction of
the time.

Why: diffusers' `VideoProcessor.postprocess_video` runs, per batch element, the processor's ``postprocess`` (the
denormalize ``(x * 0.5 + 0.5).clamp(0, 1)`` on the GPU, then ``pt_to_numpy``: ``.cpu()``, a pageable device-to-host
copy, and a CPU ``permute(0, 2, 3, 1).float().numpy()``), then for "np" ``np.stack`` of the elements (a strided copy
of the whole float32 video), for "pil" ``numpy_to_pil`` (``(images * 255).round().astype("uint8")`` in numpy, single
threaded, and an ``Image.fromarray`` per frame). For LTX-Video distilled at 121 x 512 x 768 in bf16 on an H100 host
"np" is about 360 ms of a 1.07 s patched generation: the pageable copy of 285 MB ~155 ms, the conversion 27-58 ms,
``np.stack`` ~150 ms; "pil" (LTXPipeline's default) about 0.5-0.6 s: the same copy and conversion, then ~300-400 ms
of numpy arithmetic.

What, "np": `fast_postprocess_video` runs diffusers' own denormalize (``processor.postprocess(frames, "pt")``,
exactly what the original runs on the GPU), then copies each element's frames to the host in chunks (`CHUNK_BYTES`)
through two small reused pinned buffers (`_stream`: a ``non_blocking`` copy and a CUDA event per chunk: while chunk
k travels, the CPU converts chunk k-1 with one ``copy_`` into the float32 result, allocated once), which is the one
conversion ``.float()`` makes, value for value. The result is the array diffusers returns: the same shape, dtype,
values (bit for bit, NaN payloads included) and strides. Its memory order is diffusers': a contiguous
``[B, C, T, H, W]`` video gives a ``(B, T, H, W, C)`` array laid out as ``[B][C][T][H][W]``; the strides of its
size-1 dimensions (which ``np.stack`` and torch choose by rules of their own) are read from diffusers itself, by
running the original on a tiny CPU tensor of the same pattern of sizes (at most 32 elements) on every call.

What, "pil": the same denormalize, then ``numpy_to_pil``'s uint8 frames computed on the device (`_to_uint8`:
``(x.float() * 255).round()`` to uint8, a contiguous ``[T, H, W, C]``), and only those bytes (a quarter of the
float32 video) copied to the host through the same pinned buffers (`_stream`) into a fresh array per element, then
``numpy_to_pil``'s own ``Image.fromarray`` calls on its frames (`_frames`; one channel as mode "L"). The same bytes,
value for value: ``.float()`` is exact; numpy's float32 array times the Python int 255 is a float32 multiply (numpy
2's weak scalars: the result stays float32), IEEE round to nearest, as torch's float32 ``mul``; numpy's ``round``
and ``torch.round`` both round half to even; the uint8 conversion of an integer in [0, 255] is exact in both. That
holds only for values in [0, 1]: NaN converts to uint8 differently in numpy and torch, and values outside [0, 255]
are implementation-defined. So "pil" runs only where the denormalize clamps (``config.do_normalize`` True, no
``do_denormalize`` argument) and a device check (`_in_unit_range`: ``aminmax``, NaN propagating, one sync per
element) finds every value in [0, 1]; otherwise diffusers' original runs. The result is diffusers': a list per batch
element of lists of ``PIL.Image.Image``, each of the same mode, size and bytes.

When: `fast_postprocess_video` takes a call only where ``output_type`` is "np" or "pil" with no other argument, the
video is a contiguous 5-D CUDA tensor of bf16, fp16 or fp32 with elements and no autograd history, and the processor
runs diffusers' own ``postprocess_video``, ``postprocess``, ``pt_to_numpy``, ``denormalize`` and
``_denormalize_conditionally`` (and for "pil" ``numpy_to_pil``; none replaced on its class or on the instance);
anything else, and any exception on the way (a guard never raises), runs diffusers' original and returns its result.
The first call of each signature (output type, device, dtype, shape, processor class) also runs the original and
compares (an array's shape, dtype, strides and bytes; "pil": the nesting and each image's type, mode, size and
bytes); a mismatch, or an exception, warns once and sends every later call to the original for the process.
``DIFFUSERS_FASTPATH_DISABLE=1`` sends every call to the original too. `STATS` counts fast calls and fallbacks by
reason (process-wide; `report` shows them for a pipeline it is installed on).

Images: `fast_postprocess_image` does the same for ``VaeImageProcessor.postprocess`` of a contiguous 4-D CUDA batch
``[B, C, H, W]`` (FLUX.1, Qwen-Image, Z-Image, ...; ~10-15 ms of host work for a 1024 x 1024 "pil" image), with the
same pieces: diffusers' denormalize (``VaeImageProcessor.postprocess(processor, image, "pt")``), for "pil" the range
check, device conversion and pinned copy (`_uint8_host`) and ``numpy_to_pil``'s ``Image.fromarray`` calls, for "np"
the pinned copy into diffusers' float32 ``(B, H, W, C)`` array (strides from `_strides`). Only without other
arguments (no ``do_denormalize``), for diffusers' `VaeImageProcessor` or a subclass keeping ``postprocess``,
``pt_to_numpy``, ``denormalize``, ``_denormalize_conditionally`` (and for "pil" ``numpy_to_pil``); anything else runs
``type(processor).postprocess``. The same first-call check (keyed by "image" or "video" too), the same switch and
`STATS` (`_serve`).

Where: `install` sets it as the ``postprocess_video`` instance attribute of a pipeline's ``video_processor`` (a
``functools.partial`` of this function and the processor, which copies and pickles with it), and
`fast_postprocess_image` as the ``postprocess`` instance attribute of its ``image_processor``; `patch` installs
them, `unpatch` removes them (only these).
"""

from __future__ import annotations

import contextlib
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
_PIL_METHODS = ("numpy_to_pil",)  # and for "pil" this one
# an image processor's methods the fast path stands for (diffusers' `VaeImageProcessor`'s own)
_IMAGE_METHODS = ("postprocess", "pt_to_numpy", "denormalize", "_denormalize_conditionally")

STATS = Site("postprocess")  # fast calls and fallbacks by reason, image and video, process-wide
_verified: set = set()  # signatures whose first fast call matched the original (shape, dtype, strides, bytes)
_disabled: list[str] = []  # why the fast path is off for this process (empty: it is on)
_buffers: dict[tuple, tuple[threading.Lock, torch.Tensor, torch.Tensor]] = {}
_buffers_lock = threading.Lock()

REASON_ENV = "DIFFUSERS_FASTPATH_DISABLE is set"
REASON_DISABLED = "disabled after a mismatch or an error"
REASON_LAYOUT = "diffusers' result is not laid out as [B][C][T][H][W]"
REASON_BUSY = "pinned buffers in use by another thread"
REASON_RANGE = "values outside [0, 1] after the denormalize (NaN)"
REASON_NO_CLAMP = "pil without do_normalize (no clamp to [0, 1])"
REASON_PIL = "Image.fromarray refused the frames"
_CONVERT_BYTES = 64 << 20  # float32 bytes of the "pil" path's temporary on the device (whole frames, at least one)


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


@contextlib.contextmanager
def _held_buffers(device: torch.device, dtype: torch.dtype, chunk_bytes: int):
    """The two pinned buffers of `chunk_bytes` of `dtype` (at least one element) for this call, held until the block
    ends; None where another thread holds them (the call then gives way: `REASON_BUSY`)."""
    lock, *bufs = _pinned(device, dtype, max(1, chunk_bytes // dtype.itemsize))
    if not lock.acquire(blocking=False):
        yield None
        return
    try:
        yield bufs
    finally:
        lock.release()


def _call_refusal(x: Any, ndim: int, what: str, output_type: str, extra: bool) -> str | None:
    """The checks both entry points make of a call: the switches, the output type, no other argument (`extra`), a
    contiguous `ndim`-D tensor of bf16, fp16 or fp32 with elements, where the pinned copy serves, no autograd."""
    if _env_disabled():
        return REASON_ENV
    if _disabled:
        return REASON_DISABLED
    if output_type not in ("np", "pil"):
        return f"output_type={output_type!r}"
    if extra:
        return "keyword arguments"
    if not isinstance(x, torch.Tensor):
        return "not a tensor"
    if not _device_ok(x):
        return f"{x.device.type} tensor"
    if x.dim() != ndim:
        return f"{x.dim()}-D {what}"
    if x.dtype not in _DTYPES:
        return f"{x.dtype}"
    if x.numel() == 0:
        return "no elements"
    if not x.is_contiguous():
        return f"non-contiguous {what}"
    if x.requires_grad and torch.is_grad_enabled():
        return "requires grad"
    return None


def _refusal(processor: Any, video: Any, output_type: str, kwargs: dict) -> str | None:
    """Why the fast path does not take this call, or None. Attribute reads only; never raises (the caller catches)."""
    from diffusers.video_processor import VideoProcessor

    why = _call_refusal(video, 5, "video", output_type, bool(kwargs))
    if why is not None:
        return why
    why = _class_refusal(processor, VideoProcessor, _METHODS + (_PIL_METHODS if output_type == "pil" else ()),
                         "postprocess_video")
    if why is not None:
        return why
    if output_type == "pil" and processor.config.do_normalize is not True:
        return REASON_NO_CLAMP
    return None


def _strides(run: Any, shape: tuple[int, ...], dtype: torch.dtype, perm: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides (bytes) of diffusers' float32 result for a contiguous tensor of `shape` and `dtype` whose
    dimensions come out in the order `perm` (video ``[B, C, T, H, W]`` -> ``(B, T, H, W, C)``, image ``[B, C, H, W]``
    -> ``(B, H, W, C)``), or None where its memory order is not the input's. Read from ``run`` (diffusers' original)
    on a CPU tensor of the same pattern of sizes (every size above 1 made 2): its dimensions of size 1 have the
    stride of the dimensions inside them (the product of their sizes), whatever rule picked their place; the others
    must have the strides of the float32 input array transposed to `perm`."""
    proxy = tuple(1 if s == 1 else 2 for s in shape)
    got = run(torch.zeros(proxy, dtype=dtype))
    out_shape = tuple(shape[d] for d in perm)
    n = len(shape)
    if not isinstance(got, np.ndarray) or got.shape != tuple(1 if s == 1 else 2 for s in out_shape) \
            or got.dtype != np.float32:
        return None
    item = 4
    mem = [item] * n  # the input's C-order strides in float32
    for d in range(n - 2, -1, -1):
        mem[d] = mem[d + 1] * shape[d + 1]
    want = tuple(mem[d] for d in perm)
    big = [d for d in range(n) if out_shape[d] > 1]
    strides = []
    for d in range(n):
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


def _stream(flat: torch.Tensor, dst: torch.Tensor, bufs: list[torch.Tensor]) -> None:
    """Copy the 1-D tensor `flat` (on the video's device) into the 1-D host tensor `dst` of the same length, chunk by
    chunk through the two host buffers `bufs` (of `flat`'s dtype; each chunk one ``copy_`` out of a buffer into
    `dst`, which converts to `dst`'s dtype). Double-buffered: chunk k+1 travels into one buffer while the CPU copies
    chunk k out of the other (whose previous chunk, k-1, was copied out in the iteration before). Returns once every
    copy is done, an exception included (no copy may still be writing a buffer the next call uses)."""
    per, n = flat.numel(), bufs[0].numel()
    starts = range(0, per, n)
    tokens: list = [None] * len(starts)
    try:
        tokens[0] = _copy_async(bufs[0][:min(n, per)], flat[:n])
        for k, s in enumerate(starts):
            e = min(s + n, per)
            if k + 1 < len(starts):
                e1 = min(e + n, per)
                tokens[k + 1] = _copy_async(bufs[(k + 1) % 2][:e1 - e], flat[e:e1])
            _wait(tokens[k])
            tokens[k] = None
            dst[s:e].copy_(bufs[k % 2][:e - s])
    finally:
        for token in tokens:
            _wait(token)


def _fast(processor: Any, video: torch.Tensor, output_type: str, chunk_bytes: int) -> Any:
    """The fast path for `output_type`: its result, or why it was not taken (a string)."""
    if output_type == "pil":
        return _fast_pil(processor, video, chunk_bytes)
    return _fast_np(processor, video, chunk_bytes)


def _fast_np(processor: Any, video: torch.Tensor, chunk_bytes: int) -> np.ndarray | str:
    """The pinned, chunked copy: the result, or why it was not taken (a layout this does not reproduce)."""
    B, C, T, H, W = video.shape
    strides = _strides(lambda v: _original(processor, v, "np", {}), tuple(video.shape), video.dtype, (0, 2, 3, 4, 1))
    if strides is None:
        return REASON_LAYOUT
    per = C * T * H * W
    mem = np.empty(B * per, np.float32)
    out = torch.from_numpy(mem)
    with _held_buffers(video.device, video.dtype, chunk_bytes) as bufs:
        if bufs is None:
            return REASON_BUSY
        for b in range(B):
            pt = processor.postprocess(video[b].permute(1, 0, 2, 3), "pt")  # diffusers' own denormalize
            src = pt.permute(1, 0, 2, 3)
            if not src.is_contiguous() or src.dtype != video.dtype or src.device != video.device:
                return REASON_LAYOUT
            _stream(src.reshape(-1), out[b * per:(b + 1) * per], bufs)
            del pt, src
    return np.ndarray((B, T, H, W, C), np.float32, buffer=mem, strides=strides)


def _in_unit_range(x: torch.Tensor) -> bool:
    """Whether every value of `x` is in [0, 1] (no NaN: NaN propagates through ``aminmax`` and fails both
    comparisons). One reduction on the device, one sync."""
    lo, hi = torch.aminmax(x)
    return bool(torch.stack((lo >= 0, hi <= 1)).all())


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    """``numpy_to_pil``'s ``(images * 255).round().astype("uint8")`` of ``pt_to_numpy(x)`` (``x``: ``[T, C, H, W]``
    with every value in [0, 1]) on x's device: a contiguous ``[T, H, W, C]`` uint8. The same bytes: ``.float()`` is
    exact; numpy's float32 array times the Python int 255 (a weak scalar) is a float32 multiply, IEEE round to
    nearest, as torch's float32 ``mul`` by 255; numpy's ``round`` and ``torch.round`` both round half to even; the
    uint8 conversion of an integer in [0, 255] is exact in both. Converted `_CONVERT_BYTES` of float32 at a time
    (whole frames), so the float32 temporary stays small."""
    T, C, H, W = x.shape
    out = torch.empty((T, H, W, C), dtype=torch.uint8, device=x.device)
    step = max(1, _CONVERT_BYTES // (4 * C * H * W))
    for t in range(0, T, step):
        f = x[t:t + step].permute(0, 2, 3, 1).to(torch.float32, copy=True)  # (a copy: the in-place ops below)
        out[t:t + step].copy_(f.mul_(255).round_())
    return out


def _frames(u8: np.ndarray) -> list:
    """The last step of diffusers' ``numpy_to_pil`` on its uint8 ``[T, H, W, C]`` array: the same ``Image.fromarray``
    calls, one channel as mode "L"."""
    from PIL import Image

    if u8.shape[-1] == 1:
        return [Image.fromarray(image.squeeze(), mode="L") for image in u8]
    return [Image.fromarray(image) for image in u8]


def _uint8_host(pt: torch.Tensor, bufs: list[torch.Tensor]) -> np.ndarray | str:
    """``numpy_to_pil``'s uint8 array of the denormalized ``[N, C, H, W]`` `pt` (N frames or images): made on the
    device (`_to_uint8`) where every value is in [0, 1] (`_in_unit_range`), copied through the pinned buffers
    (`_stream`) into a fresh contiguous ``[N, H, W, C]`` array; or why not (a string)."""
    if not _in_unit_range(pt):
        return REASON_RANGE
    u8 = _to_uint8(pt)
    host = np.empty(tuple(u8.shape), np.uint8)  # (its own memory: PIL maps some modes onto it)
    _stream(u8.view(-1), torch.from_numpy(host).view(-1), bufs)
    return host


def _fast_pil(processor: Any, video: torch.Tensor, chunk_bytes: int) -> list | str:
    """The uint8 frames made on the device, copied through the pinned buffers, then diffusers' ``Image.fromarray``
    calls: the result, or why it was not taken (a value outside [0, 1], NaN included; a layout it does not know)."""
    B, C, T, H, W = video.shape
    hosts = []
    with _held_buffers(video.device, torch.uint8, chunk_bytes) as bufs:
        if bufs is None:
            return REASON_BUSY
        for b in range(B):
            pt = processor.postprocess(video[b].permute(1, 0, 2, 3), "pt")  # diffusers' own denormalize
            if pt.shape != (T, C, H, W) or pt.dtype != video.dtype or pt.device != video.device:
                return REASON_LAYOUT
            host = _uint8_host(pt, bufs)
            if isinstance(host, str):
                return host
            hosts.append(host)
            del pt
    try:
        return [_frames(host) for host in hosts]
    except Exception:  # noqa: BLE001 - diffusers' own calls fail on these frames (a 1 x 1 one-channel frame squeezes
        return REASON_PIL  # to 0-D): the original runs and raises its own error; nothing of ours is broken


def _same(got: Any, ref: Any) -> bool:
    """Whether the fast result is diffusers' `ref`: for an array shape, dtype, strides and bytes; for "pil" the same
    nesting (video: a list per batch element of lists of images; image: a list of images) and per image its type,
    mode, size and bytes."""
    if isinstance(got, np.ndarray):
        return (isinstance(ref, np.ndarray) and got.shape == ref.shape and got.dtype == ref.dtype
                and got.strides == ref.strides and got.tobytes() == ref.tobytes())
    if type(got) is list:
        return type(ref) is list and len(got) == len(ref) and all(_same(g, r) for g, r in zip(got, ref))
    from PIL import Image

    return (isinstance(got, Image.Image) and type(got) is type(ref) and got.mode == ref.mode
            and got.size == ref.size and got.tobytes() == ref.tobytes())


def _disable(why: str) -> None:
    if not _disabled:
        _disabled.append(why)
    warn_once(f"diffusers_fastpath: the fast image/video post-processing is off for this process ({why}); "
              "postprocess and postprocess_video run as diffusers wrote them")


def _serve(guard: Any, key: Any, fast: Any, original: Any) -> Any:
    """The shared machinery of both entry points: `guard()` says why not (or None; a guard that raises refuses),
    `fast()` gives the result or why not (a string), `original()` diffusers' result. The first call of each `key()`
    is checked against the original; a mismatch or an exception warns once and turns the fast path off."""
    try:
        reason = guard()
    except Exception as exc:  # noqa: BLE001 - a guard never raises: refuse, say so once
        warn_once(f"diffusers_fastpath: the post-processing guard failed ({exc!r}); the original runs")
        reason = "guard error"
    if reason is None:
        try:
            sig = key()
            got = fast()
        except Exception as exc:  # noqa: BLE001 - any failure: the original, once loudly, then off
            _disable(f"{type(exc).__name__}: {exc}")
            reason = REASON_DISABLED
        else:
            if isinstance(got, str):
                reason = got
            elif sig in _verified:
                STATS.fast += 1
                return got
            else:
                ref = original()
                if _same(got, ref):
                    _verified.add(sig)
                    STATS.fast += 1
                    return got
                _disable(f"its first call of {sig[:-1]} differed from diffusers' result")
                STATS.fallback[REASON_DISABLED] += 1
                return ref
    STATS.fallback[reason] += 1
    return original()


def fast_postprocess_video(processor: Any, video: Any, output_type: str = "np", *, _chunk_bytes: int | None = None,
                           **kwargs: Any) -> Any:
    """``processor.postprocess_video(video, output_type, **kwargs)`` as diffusers' `VideoProcessor` runs it, the
    same result; for ``output_type="np"`` of a contiguous CUDA video a pinned, chunked copy to the host instead of
    ``.cpu()``, ``.float()`` and ``np.stack``; for ``"pil"`` the uint8 frames made on the device and only they copied
    (see the module's docstring). Anything it does not take runs diffusers' original."""
    chunk = CHUNK_BYTES if _chunk_bytes is None else _chunk_bytes
    return _serve(lambda: _refusal(processor, video, output_type, kwargs),
                  lambda: ("video", output_type, str(video.device), video.dtype, tuple(video.shape), type(processor)),
                  lambda: _fast(processor, video, output_type, chunk),
                  lambda: _original(processor, video, output_type, kwargs))


# ---- images: VaeImageProcessor.postprocess --------------------------------------------------------------------


def _image_original(processor: Any, image: Any, output_type: str, args: tuple, kwargs: dict) -> Any:
    """What ``processor.postprocess(...)`` runs without this package's instance attribute: its class's method."""
    return type(processor).postprocess(processor, image, output_type, *args, **kwargs)


def _image_class_ok(processor: Any, output_type: str | None = None) -> str | None:
    """None where `processor` is diffusers' `VaeImageProcessor` or a subclass keeping its own ``postprocess``,
    ``pt_to_numpy``, ``denormalize``, ``_denormalize_conditionally`` (and for "pil" ``numpy_to_pil``), neither on
    the class nor on the instance replaced (but for this package's ``postprocess``); else why not."""
    from diffusers.image_processor import VaeImageProcessor

    return _class_refusal(processor, VaeImageProcessor, _IMAGE_METHODS + (_PIL_METHODS if output_type == "pil" else ()),
                          "postprocess")


def _class_refusal(processor: Any, base: type, names: tuple[str, ...], ours: str) -> str | None:
    """None where `processor` is a `base` whose methods `names` are `base`'s own, on its class and not replaced on
    the instance (but for `ours`, the one this package sets there); else why not."""
    cls = type(processor)
    if not isinstance(processor, base):
        return f"{cls.__name__} is not a {base.__name__}"
    own = getattr(processor, "__dict__", {})
    for name in names:
        if getattr(cls, name) is not getattr(base, name):
            return f"{cls.__name__}.{name} overridden"
        if name != ours and name in own:
            return f"{name} replaced on the instance"
    return None


def _image_refusal(processor: Any, image: Any, output_type: str, args: tuple, kwargs: dict) -> str | None:
    """Why the fast path does not take this ``postprocess`` call, or None. Attribute reads only."""
    why = _call_refusal(image, 4, "image", output_type, bool(args or kwargs))
    if why is not None:
        return why
    why = _image_class_ok(processor, output_type)
    if why is not None:
        return why
    if output_type == "pil" and processor.config.do_normalize is not True:
        return REASON_NO_CLAMP
    return None


def _fast_image(processor: Any, image: torch.Tensor, output_type: str, chunk_bytes: int) -> Any:
    """The image batch's fast path: the result, or why it was not taken (a string)."""
    from diffusers.image_processor import VaeImageProcessor

    B, C, H, W = image.shape
    strides = None
    if output_type == "np":
        strides = _strides(lambda x: _image_original(processor, x, "np", (), {}), tuple(image.shape), image.dtype,
                           (0, 2, 3, 1))
        if strides is None:
            return REASON_LAYOUT
    with _held_buffers(image.device, torch.uint8 if output_type == "pil" else image.dtype, chunk_bytes) as bufs:
        if bufs is None:
            return REASON_BUSY
        pt = VaeImageProcessor.postprocess(processor, image, "pt")  # diffusers' own denormalize
        if pt.shape != image.shape or pt.dtype != image.dtype or pt.device != image.device or not pt.is_contiguous():
            return REASON_LAYOUT
        if output_type == "pil":
            host = _uint8_host(pt, bufs)
        else:
            mem = np.empty(pt.numel(), np.float32)
            _stream(pt.reshape(-1), torch.from_numpy(mem), bufs)
            host = np.ndarray((B, H, W, C), np.float32, buffer=mem, strides=strides)
        del pt
    if isinstance(host, str) or output_type == "np":
        return host
    try:
        return _frames(host)
    except Exception:  # noqa: BLE001 - diffusers' own calls fail on these images (1 x 1, one channel): its error
        return REASON_PIL


def fast_postprocess_image(processor: Any, image: Any, output_type: str = "pil", *args: Any,
                           _chunk_bytes: int | None = None, **kwargs: Any) -> Any:
    """``processor.postprocess(image, output_type, ...)`` as diffusers' `VaeImageProcessor` runs it, the same
    result; for ``"pil"`` of a contiguous 4-D CUDA batch the uint8 images made on the device and only they copied,
    for ``"np"`` the pinned, chunked copy into diffusers' float32 array (see the module's docstring). Anything it
    does not take runs diffusers' original."""
    chunk = CHUNK_BYTES if _chunk_bytes is None else _chunk_bytes
    return _serve(lambda: _image_refusal(processor, image, output_type, args, kwargs),
                  lambda: ("image", output_type, str(image.device), image.dtype, tuple(image.shape), type(processor)),
                  lambda: _fast_image(processor, image, output_type, chunk),
                  lambda: _image_original(processor, image, output_type, args, kwargs))


# ---- wiring -----------------------------------------------------------------------------------------------------


def _ours(processor: Any, attr: str, fn: Any) -> bool:
    own = getattr(processor, "__dict__", {}).get(attr)
    return isinstance(own, functools.partial) and own.func is fn and own.args[:1] == (processor,)


def installed(processor: Any) -> bool:
    """Whether `processor` has this package's ``postprocess_video`` or ``postprocess`` on the instance."""
    return _ours(processor, "postprocess_video", fast_postprocess_video) or \
        _ours(processor, "postprocess", fast_postprocess_image)


def installed_on(pipe: Any) -> bool:
    """Whether `pipe`'s ``video_processor`` or ``image_processor`` has this package's method."""
    return any(installed(getattr(pipe, name, None)) for name in ("video_processor", "image_processor"))


def _eligible(processor: Any) -> bool:
    from diffusers.video_processor import VideoProcessor

    cls = type(processor)
    return isinstance(processor, VideoProcessor) and all(
        getattr(cls, name) is getattr(VideoProcessor, name) for name in _METHODS)


_SITES = (("video_processor", "postprocess_video", fast_postprocess_video),
          ("image_processor", "postprocess", fast_postprocess_image))


def install(pipe: Any) -> bool:
    """Set `fast_postprocess_video` as ``pipe.video_processor.postprocess_video`` where the pipeline holds diffusers'
    `VideoProcessor` (or a subclass that keeps its methods), and `fast_postprocess_image` as
    ``pipe.image_processor.postprocess`` where it holds diffusers' `VaeImageProcessor` (or a subclass that keeps the
    methods involved), each where the processor has no such method of its own on the instance; True where either is
    there now (set now or before)."""
    done = False
    for attr, name, fn in _SITES:
        processor = getattr(pipe, attr, None)
        if processor is None:
            continue
        ok = _eligible(processor) if attr == "video_processor" else _image_class_ok(processor) is None
        if not ok:
            continue
        if _ours(processor, name, fn):
            done = True
            continue
        if name in processor.__dict__:
            logger.info(f"diffusers_fastpath: {type(pipe).__name__}.{attr} has a {name} of its own; left as it is")
            continue
        processor.__dict__[name] = functools.partial(fn, processor)
        logger.info(f"diffusers_fastpath: {type(pipe).__name__}.{attr}.{name} takes the pinned copy for output_type "
                    "'np' and 'pil'")
        done = True
    return done


def uninstall(pipe: Any) -> None:
    """Remove what `install` set on ``pipe.video_processor`` and ``pipe.image_processor`` (nothing else)."""
    for attr, name, fn in _SITES:
        processor = getattr(pipe, attr, None)
        if processor is not None and _ours(processor, name, fn):
            del processor.__dict__[name]


def reset() -> None:
    """Forget the verified signatures, the disabling and the counters (tests)."""
    _verified.clear()
    _disabled.clear()
    STATS.reset()
