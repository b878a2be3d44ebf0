"""Is a VAE's convolution the same number in channels-last? What a channels-first one costs in layout transforms.

A VAE's decode is mostly convolutions (cuDNN's); the fused kernels leave them as they are. cuDNN's tensor-core
kernels read channels-last (NHWC / NDHWC): for a channels-first input (what diffusers' VAEs pass) it may transpose the
input and the output around the kernel (``nchwToNhwcKernel`` / ``nhwcToNchwKernel``), or pick another engine. If the
same engine runs on a channels-last input without the transposes, the result is the same number and the transposes
are time a patched VAE could save; if the engine differs, so may the rounding, and the layout is not ours to change.

This script records every convolution of one decode (or encode) of a bench model's VAE on the GPU (its published
config, random weights, ``--frames x --height x --width``), and for each distinct one (input shape and strides, weight
shape, stride, padding, dilation, groups), on fresh random operands: ``torch.equal`` of the channels-first result and
the channels-last one (input and weight in ``channels_last(_3d)``; on ``--inputs`` inputs, the others wide-ranged:
another engine can agree on some inputs only), both timed (CUDA events, the median of
``--repeats`` calls), and the kernels each ran (``torch.profiler``), to see the transposes and the engine; and what the
ways to get there cost: the input written channels-last by its producer and the result made channels-first again
(``.contiguous()``, for the ops after it), and aten's copies standing for both of cuDNN's transposes.

    python tools/conv_layout_probe.py --model wan-14b --call decode --frames 5 --height 480 --width 832
    python tools/conv_layout_probe.py --model flux-dev --call decode --height 1024 --width 1024

A developer's tool (a CUDA GPU); prints one row per convolution and a summary (time the recorded convolutions take
channels-first, in their layout transforms, and channels-last; how many are bit-identical), and writes it as JSON to
``--json`` where given. cuDNN's choice follows ``torch.backends.cudnn.benchmark`` (eager's default, off, here).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_fastpath.ops._policy import wide_like


class Recorder(TorchDispatchMode):
    """Counts the distinct ``aten.convolution`` calls run inside it: (input shape, input strides, weight shape, bias,
    stride, padding, dilation, transposed, output padding, groups, dtype) -> calls."""

    def __init__(self) -> None:
        super().__init__()
        self.convs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            x, w, b, stride, padding, dilation, transposed, out_pad, groups = args
            self.convs[(tuple(x.shape), tuple(x.stride()), tuple(w.shape), b is not None, tuple(stride),
                        tuple(padding), tuple(dilation), bool(transposed), tuple(out_pad), int(groups),
                        str(x.dtype))] += 1
        return func(*args, **(kwargs or {}))


def record(model: str, call: str, frames: int, height: int, width: int, dtype: str, seed: int, dev: torch.device):
    """The distinct convolutions of one ``call`` of ``model``'s VAE on ``dev``, with their counts."""
    from unfused_census import vae_call  # this folder's: the bench model's VAE and the call that runs it

    vae, run = vae_call(model, call, frames, height, width, str(dev), dtype, seed)
    rec = Recorder()
    with torch.no_grad(), rec:
        run(vae)
    del vae
    torch.cuda.empty_cache()
    return rec.convs


def _time(fn, repeats: int) -> float:
    fn()
    if not torch.cuda.is_available():  # a CPU dry run of the script: the host clock
        import time

        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) / repeats * 1e3
    torch.cuda.synchronize()
    ms = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def _kernels(fn) -> list[tuple[str, float]]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in prof.events() if e.device_type == DeviceType.CUDA]


def _is_layout(name: str) -> bool:
    return "nchwToNhwc" in name or "nhwcToNchw" in name


def probe(key: tuple, repeats: int, dev: torch.device, inputs: int = 4) -> dict:
    shape, strides, wshape, has_bias, stride, padding, dilation, transposed, out_pad, groups, dtype = key
    dt = getattr(torch, dtype.split(".")[-1])
    x = torch.empty_strided(shape, strides, device=dev, dtype=dt).normal_()
    w = torch.randn(wshape, device=dev, dtype=dt) / (wshape[1] * max(1, torch.Size(wshape[2:]).numel())) ** 0.5
    b = torch.randn(wshape[1] if transposed else wshape[0], device=dev, dtype=dt) if has_bias else None
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x_cl, w_cl = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)

    def first():
        return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, transposed, out_pad, groups)

    def last():
        return torch.ops.aten.convolution(x_cl, w_cl, b, stride, padding, dilation, transposed, out_pad, groups)

    def cl_input():  # a producer that writes the input channels-last; the result back channels-first for the rest
        return torch.ops.aten.convolution(x_cl, w_cl, b, stride, padding, dilation, transposed, out_pad,
                                          groups).contiguous()

    def aten_transposes():  # aten's copies where cuDNN's transposes were
        return torch.ops.aten.convolution(x.contiguous(memory_format=fmt), w_cl, b, stride, padding, dilation,
                                          transposed, out_pad, groups).contiguous()

    y1, y2 = first(), last()
    # the same convolution on more inputs, wide-ranged (`_policy.wide_like`): another engine's sums in another order
    # can round alike on some inputs only (session 39: an 8-channel fp16 one on one call in eight)
    agree = [bool(torch.equal(y1, y2))]
    for seed in range(1, inputs):
        xs = wide_like(x, seed)
        agree.append(bool(torch.equal(
            torch.ops.aten.convolution(xs, w, b, stride, padding, dilation, transposed, out_pad, groups),
            torch.ops.aten.convolution(xs.contiguous(memory_format=fmt), w_cl, b, stride, padding, dilation,
                                       transposed, out_pad, groups))))
    k1, k2 = _kernels(first), _kernels(last)
    return dict(input=list(shape), input_strides=list(strides), weight=list(wshape), stride=list(stride),
                padding=list(padding), groups=groups, dtype=dtype, equal=all(agree), inputs_equal=sum(agree),
                inputs=len(agree),
                max_abs_diff=float((y1.float() - y2.float()).abs().max()), out_channels_last=y2.is_contiguous(
                    memory_format=fmt), first_ms=_time(first, repeats), last_ms=_time(last, repeats),
                first_layout_ms=sum(t for n, t in k1 if _is_layout(n)),
                cl_input_ms=_time(cl_input, repeats), aten_transposes_ms=_time(aten_transposes, repeats),
                cl_input_equal=bool(torch.equal(cl_input(), y1)),
                first_kernels=[n[:110] for n, _ in k1], last_kernels=[n[:110] for n, _ in k2])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan-14b", help="a bench model with a VAE (bench --levels vae's models)")
    p.add_argument("--call", choices=("decode", "encode"), default="decode")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--inputs", type=int, default=4,
                   help="inputs each convolution is compared on (the first standard normal, the others wide-ranged)")
    p.add_argument("--json", help="write the rows and the summary here")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script, no kernels, host times)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    convs = record(args.model, args.call, args.frames, args.height, args.width, args.dtype, args.seed, dev)
    print(f"{args.model} {args.call} {args.frames}x{args.height}x{args.width}: {sum(convs.values())} convolutions, "
          f"{len(convs)} distinct; cudnn {torch.backends.cudnn.version()}, benchmark {torch.backends.cudnn.benchmark}")
    rows, tot = [], collections.Counter()
    for key, n in sorted(convs.items(), key=lambda kv: -kv[1]):
        r = dict(calls=n, **probe(key, args.repeats, dev, args.inputs))
        rows.append(r)
        tot["first"] += n * r["first_ms"]
        tot["last"] += n * r["last_ms"]
        tot["layout"] += n * r["first_layout_ms"]
        tot["cl_input"] += n * r["cl_input_ms"]
        tot["aten"] += n * r["aten_transposes_ms"]
        tot["equal_calls"] += n * r["equal"]
        tot["calls"] += n
        print(f"{n:4d} x in {tuple(r['input'])} w {tuple(r['weight'])} s{tuple(r['stride'])} p{tuple(r['padding'])}: "
              f"first {r['first_ms']:.3f} ms (layout {r['first_layout_ms']:.3f}), last {r['last_ms']:.3f} ms, "
              f"channels-last input then back {r['cl_input_ms']:.3f} ms, aten's transposes {r['aten_transposes_ms']:.3f}"
              f" ms, equal on {r['inputs_equal']}/{r['inputs']} inputs / {r['cl_input_equal']} (max diff "
              f"{r['max_abs_diff']:.3g})\n"
              f"      first: {' | '.join(r['first_kernels'])}\n      last:  {' | '.join(r['last_kernels'])}",
              flush=True)
    summary = dict(calls=tot["calls"], equal_calls=tot["equal_calls"], first_ms=tot["first"], last_ms=tot["last"],
                   first_layout_ms=tot["layout"], cl_input_ms=tot["cl_input"], aten_transposes_ms=tot["aten"])
    print(f"summary: {summary['equal_calls']}/{summary['calls']} calls bit-identical channels-last; the recorded "
          f"convolutions {tot['first']:.1f} ms channels-first (layout transforms {tot['layout']:.1f} ms, under the "
          f"profiler), {tot['last']:.1f} ms channels-last; {tot['cl_input']:.1f} ms with the input written channels-last "
          f"and the result made channels-first again, {tot['aten']:.1f} ms with aten's copies for cuDNN's transposes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
