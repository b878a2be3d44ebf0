"""The profile level: one step per mode under ``torch.profiler``, kernel time by category, GPU idle gaps."""

from __future__ import annotations

import re
from typing import Any, Callable

from ..subject import Subject
from ..timing import Clock


# First match wins, on the kernel's name (CUDA) or the leaf op's name (CPU); our kernels live in the
# diffusers_fastpath namespace. Inductor names its kernels triton_{poi,per,red,tem}_fused_<ops>. A convolution's
# cuDNN kernels (``sm90_xmma_fprop_implicit_gemm_...``, ``implicit_convolve_sgemm``, ...) are "conv", part of the floor
# with the GEMMs; the layout transforms cuDNN runs around a channels-first convolution (``nchwToNhwcKernel``,
# ``nhwcToNchwKernel``) are "conv layout", outside it (a VAE's profile says what they cost).
CATEGORIES: list[tuple[str, re.Pattern]] = [
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in [
        ("fused", r"diffusers_fastpath|fastpath"),
        ("attention", r"flash|fmha|attention|attn|sdpa|scaled_dot_product|softmax"),
        ("conv layout", r"nchwToNhwc|nhwcToNchw"),
        ("conv", r"fprop|dgrad|wgrad|implicit_convolve|winograd|cudnn|conv(olution|_?[123]d|_depthwise)|"
                 r"aten::(_?convolution|cudnn_convolution)\b"),
        ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|triton_tem|aten::(mm|addmm|bmm|baddbmm|matmul|linear)\b"),
        ("norm", r"norm"),
        ("copy/cat", r"copy|\bcat\b|_cat_|CatArray|memcpy|memset|index|gather|scatter|"
                     r"aten::(cat|to|_to_copy|contiguous|clone|stack)\b"),
        ("elementwise", r"elementwise|vectorized|unrolled|reduce|triton_(poi|per|red)|aten::\w+"),
    ]
]
CATEGORY_NAMES = [name for name, _ in CATEGORIES] + ["other"]
# aten ops that only make views or allocate (no kernel of their own), left out of the CPU profile
_METADATA_OPS = re.compile(
    r"aten::(view|_unsafe_view|reshape|as_strided|expand|t|transpose|permute|unsqueeze|squeeze|slice|select|split|"
    r"split_with_sizes|chunk|unbind|narrow|detach|alias|lift_fresh|resolve_conj|resolve_neg|empty|empty_like|"
    r"empty_strided|flatten|unflatten|view_as_real|view_as_complex|_reshape_alias|result_type|is_nonzero|item|"
    r"_local_scalar_dense)$"
)


def categorize(kernel_name: str) -> str:
    """The category (`CATEGORY_NAMES`) of a kernel or op name."""
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


PROFILE_TOP = 80  # the kernels (by name) that took the most time, per mode, kept in the JSON (the small ones too:
# a step's memsets and copies, to tell eager's from the patched step's)
PROFILE_SHOWN = 15  # of them, the ones the report lists


def profile_step(subject: Subject, clock: Clock) -> dict[str, Any]:
    """One step of ``subject`` under the profiler (`profile_call`)."""
    return profile_call(subject.step, clock)


def profile_call(call: Callable[[], Any], clock: Clock) -> dict[str, Any]:
    """One ``call()`` under the profiler: its kernels (CUDA) or outermost aten ops (CPU) by category, the most costly by
    name, and the GPU's idle gaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    clock.sync()
    with profile(activities=activities) as prof:
        call()
        clock.sync()
    idle = None
    if clock.cuda:  # the kernels (and memcpy/memset) the GPU ran
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        idle = idle_gaps(events)
    else:  # on CPU, the outermost aten ops (what the model's code calls), without views and allocations
        def aten(e) -> bool:
            return e.device_type == DeviceType.CPU and e.name.startswith("aten::")

        def outermost(e) -> bool:
            parent = e.cpu_parent
            while parent is not None and not aten(parent):
                parent = parent.cpu_parent
            return parent is None

        events = [e for e in prof.events() if aten(e) and not _METADATA_OPS.match(e.name) and outermost(e)]
    per = {name: {"count": 0, "ms": 0.0} for name in CATEGORY_NAMES}
    by_name: dict[str, list] = {}
    for e in events:
        c = per[categorize(e.name)]
        ms = e.time_range.elapsed_us() / 1e3
        c["count"] += 1
        c["ms"] += ms
        entry = by_name.setdefault(e.name, [categorize(e.name), 0, 0.0])
        entry[1] += 1
        entry[2] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:PROFILE_TOP]
    return dict(kernels=len(events), ms=sum(c["ms"] for c in per.values()), categories=per,
                top=[dict(name=name[:160], category=cat, count=n, ms=ms) for name, (cat, n, ms) in top],
                unit="CUDA kernels" if clock.cuda else "outermost aten ops on CPU", idle=idle)


IDLE_GAP_US = 5.0  # gaps between kernels at least this long are listed by the kernel that waited


def idle_gaps(kernels: list) -> dict[str, Any]:
    """Where the GPU sat idle in the profiled step: the time between its first kernel's start and last kernel's end
    that no kernel covers, and the kernels that waited longest after a gap. Taken under the profiler, whose host
    overhead makes launch-bound gaps longer than in the timed steps: compare modes within one run, not across runs."""
    if not kernels:
        return dict(span_ms=0.0, ms=0.0, gaps=0, by_kernel=[])
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    busy_until = kernels[0].time_range.start
    idle_us = 0.0
    gaps = 0
    by_kernel: dict[str, list] = {}
    for e in kernels:
        start = e.time_range.start
        if start > busy_until:
            gap = start - busy_until
            idle_us += gap
            if gap >= IDLE_GAP_US:
                gaps += 1
                entry = by_kernel.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += gap
        busy_until = max(busy_until, e.time_range.end)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:8]
    span_us = busy_until - kernels[0].time_range.start
    return dict(span_ms=span_us / 1e3, ms=idle_us / 1e3, gaps=gaps,
                by_kernel=[dict(kernel=name[:120], count=n, ms=us / 1e3) for name, (n, us) in top])
