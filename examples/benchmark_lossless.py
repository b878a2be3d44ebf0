"""Measure the lossless fast path on a GPU: the fused kernels against their eager chains and a device-to-device
copy, the host cost of one call, and a transformer step patched against unpatched, in one process.

    python examples/benchmark_lossless.py                           # FLUX.1-dev config, random bf16 weights, 1024x1024
    python examples/benchmark_lossless.py --model ernie-image       # ERNIE-Image config
    python examples/benchmark_lossless.py --height 512 --width 512 --json results.json

No weights are downloaded: the transformer is built from the published config with random weights (speed and
exactness do not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

import diffusers_fastpath as fp
from diffusers_fastpath.ops import (
    gated_rmsnorm_scale_shift_ref,
    modulate_scale_shift,
    modulate_scale_shift_ref,
    qk_norm_rope_ref,
    rmsnorm_scale_shift_ref,
    rotary_emb_ref,
)
from diffusers_fastpath.ops._build import load_extension
from diffusers_fastpath.testing import (
    build_ernie_image_transformer,
    build_flux_transformer,
    ernie_image_inputs,
    flux_transformer_inputs,
)


def gpu_time_us(fn, sets, iters=40, rounds=5):
    """Median over `rounds` of the mean time of `iters` calls (CUDA events), rotating input sets past the L2."""
    for s in sets[:2]:
        fn(*s)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(times)


def _row(op, shape, dtype, eager, fused, copy, nbytes, copy_bytes):
    return dict(
        op=op,
        shape=list(shape),
        dtype=str(dtype).removeprefix("torch."),
        eager_us=eager,
        fused_us=fused,
        copy_us=copy,
        fused_GBps=nbytes / fused / 1e3,
        copy_GBps=copy_bytes / copy / 1e3,
        pct_of_copy=100 * (nbytes / fused) / (copy_bytes / copy),
        speedup=eager / fused,
    )


def bench_rmsnorm_kernels(dtype):
    """ERNIE-Image's fused adaLN chains at the model's [seq, batch, dim] shapes (1024x1024, and CFG at 512x512)."""
    from diffusers.models.normalization import RMSNorm

    load_extension()
    ops = torch.ops.diffusers_fastpath
    rows = []
    for shape in [(4216, 1, 4096), (1140, 2, 4096)]:
        seq, batch, dim = shape
        norm = RMSNorm(dim, eps=1e-6).to("cuda", dtype).requires_grad_(False)
        sets = []
        for _ in range(3):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            rows_ = [torch.randn(1, batch, dim, device="cuda", dtype=dtype).expand(seq, -1, -1).contiguous() for _ in range(3)]
            update = torch.randn(batch, seq, dim, device="cuda", dtype=dtype).permute(1, 0, 2)
            sets.append((x, *rows_, update, torch.empty_like(x)))
        x, scale, shift, gate, update, _ = sets[0]
        assert torch.equal(ops._rmsnorm_scale_shift_cuda(x, norm.weight, scale, shift, norm.eps), rmsnorm_scale_shift_ref(norm, x, scale, shift))
        got = ops._gated_rmsnorm_scale_shift_cuda(x, gate, update, norm.weight, scale, shift, norm.eps)
        want = gated_rmsnorm_scale_shift_ref(norm, x, gate, update, scale, shift)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        e = x.element_size() * x.numel()
        copy = gpu_time_us(lambda x, s, h, g, u, o: o.copy_(x), sets)
        rows.append(_row(
            "rmsnorm_scale_shift", shape, dtype,
            gpu_time_us(lambda x, s, h, g, u, o: rmsnorm_scale_shift_ref(norm, x, s, h), sets),
            gpu_time_us(lambda x, s, h, g, u, o: ops._rmsnorm_scale_shift_cuda(x, norm.weight, s, h, norm.eps), sets),
            copy, 4 * e, 2 * e,
        ))
        rows.append(_row(
            "gated_rmsnorm_scale_shift", shape, dtype,
            gpu_time_us(lambda x, s, h, g, u, o: gated_rmsnorm_scale_shift_ref(norm, x, g, u, s, h), sets),
            gpu_time_us(lambda x, s, h, g, u, o: ops._gated_rmsnorm_scale_shift_cuda(x, g, u, norm.weight, s, h, norm.eps), sets),
            copy, 7 * e, 2 * e,
        ))
    return rows


def bench_kernels(dtype):
    load_extension()
    cuda_op = torch.ops.diffusers_fastpath._modulate_scale_shift_cuda.default
    rows = []
    for shape in [(1, 4096, 3072), (1, 512, 3072), (1, 4608, 3072), (2, 1024, 3072)]:
        b, l, d = shape
        sets = []
        for i in range(6):  # 6 x 25 MB inputs (+ outputs) rotate well past the 60 MB L2
            x = torch.randn(shape, device="cuda", dtype=dtype)
            shift, scale = torch.randn(b, 6 * d, device="cuda", dtype=dtype).chunk(6, dim=1)[:2]
            sets.append((x, scale, shift, torch.empty_like(x)))
        assert all(torch.equal(cuda_op(x, s, h), modulate_scale_shift_ref(x, s, h)) for x, s, h, _ in sets)
        eager = gpu_time_us(lambda x, s, h, o: modulate_scale_shift_ref(x, s, h), sets)
        fused = gpu_time_us(lambda x, s, h, o: cuda_op(x, s, h), sets)
        copy = gpu_time_us(lambda x, s, h, o: o.copy_(x), sets)
        nbytes = 2 * x.numel() * x.element_size() + 2 * scale.numel() * scale.element_size()
        rows.append(_row("modulate_scale_shift", shape, dtype, eager, fused, copy, nbytes, 2 * x.numel() * x.element_size()))
    return rows


def bench_rotary_kernels(dtype):
    """FLUX.1-dev's attention at 1024x1024: the rotary embedding alone (single block, text part) and fused with the
    QK RMSNorm and the text/image concatenation (dual block: 512 + 4096 tokens; single block: 4608)."""
    load_extension()
    ops = torch.ops.diffusers_fastpath
    heads, dim = 24, 128
    rows = []
    norms = [torch.nn.RMSNorm(dim, eps=1e-6).to("cuda", dtype).requires_grad_(False) for _ in range(2)]
    for norm in norms:
        norm.weight.normal_(1.0, 0.1)
    for txt, img in [(0, 4608), (0, 512), (512, 4096)]:
        seq = txt + img
        cos, sin = (torch.rand(seq, dim, device="cuda") * 2 - 1 for _ in range(2))
        sets = []
        for _ in range(6):  # 6 x 28 MB inputs (+ outputs) rotate well past the 60 MB L2
            x_txt = torch.randn(1, txt, heads, dim, device="cuda", dtype=dtype) if txt else None
            x_img = torch.randn(1, img, heads, dim, device="cuda", dtype=dtype)
            sets.append((x_txt, x_img, torch.empty(1, seq, heads, dim, device="cuda", dtype=dtype)))
        e = sets[0][2].numel() * sets[0][2].element_size()
        tables = 2 * cos.numel() * 4
        copy_sets = [tuple(torch.empty_like(sets[0][2]) for _ in range(2)) for _ in range(6)]
        copy = gpu_time_us(lambda a, b: b.copy_(a), copy_sets)
        if txt == 0:
            x = sets[0][1]
            assert torch.equal(ops._rotary_emb_cuda(x, cos, sin), rotary_emb_ref(x, cos, sin))
            rows.append(_row(
                "rotary_emb", (1, seq, heads, dim), dtype,
                gpu_time_us(lambda t, i, o: rotary_emb_ref(i, cos, sin), sets),
                gpu_time_us(lambda t, i, o: ops._rotary_emb_cuda(i, cos, sin), sets),
                copy, 2 * e + tables, 2 * e,
            ))
        n_txt, n_img = (norms[0] if txt else None), norms[1]
        w_txt, eps_txt = (n_txt.weight, n_txt.eps) if txt else (None, 0.0)
        fused = lambda t, i, o: ops._qk_norm_rope_cuda(t, w_txt, eps_txt, i, n_img.weight, n_img.eps, cos, sin)  # noqa: E731
        x_txt, x_img, _ = sets[0]
        exact = torch.equal(fused(x_txt, x_img, None), qk_norm_rope_ref(n_txt, x_txt, n_img, x_img, cos, sin))
        rows.append(_row(
            "qk_norm_rope" + ("" if exact else " (NOT bit-exact here: the op disables itself)"), (1, seq, heads, dim), dtype,
            gpu_time_us(lambda t, i, o: qk_norm_rope_ref(n_txt, t, n_img, i, cos, sin), sets),
            gpu_time_us(fused, sets),
            copy, 2 * e + tables, 2 * e,
        ))
    return rows


def host_us_per_call(dtype, calls=2000):
    """Host time to enqueue one call (tiny tensors, so the GPU is never the limit)."""
    x = torch.randn(1, 17, 64, device="cuda", dtype=dtype)
    shift, scale = torch.randn(1, 6 * 64, device="cuda", dtype=dtype).chunk(6, dim=1)[:2]
    cuda_op = torch.ops.diffusers_fastpath._modulate_scale_shift_cuda.default
    custom_op = torch.ops.diffusers_fastpath.modulate_scale_shift.default
    candidates = {
        "x.add(1) (baseline)": lambda: x.add(1),
        "eager chain (3 kernels)": lambda: modulate_scale_shift_ref(x, scale, shift),
        "fused, direct CUDA op": lambda: cuda_op(x, scale, shift),
        "fused, Python custom op": lambda: custom_op(x, scale, shift),
        "fused, public entry (guard + policy)": lambda: modulate_scale_shift(x, scale, shift),
    }
    out = {}
    for name, fn in candidates.items():
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return out


@torch.no_grad()
def bench_step(config, height, width, repeats, dtype):
    t0 = time.perf_counter()
    if config.startswith("ernie"):
        model = build_ernie_image_transformer(config, dtype, "cuda", seed=0)
        inputs = ernie_image_inputs(model, grid=(height // 16, width // 16), text_lens=(120,), seed=1)
    else:
        model = build_flux_transformer(config, dtype, "cuda", seed=0)
        inputs = flux_transformer_inputs(model, grid=(height // 16, width // 16), txt_tokens=512, seed=1)
    build_s = time.perf_counter() - t0

    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(**inputs).sample
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out

    times = {"eager": [], "lossless": []}
    outs = {}
    for _ in range(2):
        timed()
    for rnd in range(2):  # eager, lossless, eager, lossless: drift shows up as a spread, not as a ratio
        for mode in ("eager", "lossless"):
            if mode == "lossless":
                fp.patch(model)
                timed()  # warm-up (first call builds/loads the extension and the rotary cache)
            for _ in range(repeats):
                ms, out = timed()
                times[mode].append(ms)
            outs.setdefault(mode, out)
            if mode == "lossless":
                rep = fp.report(model)
                fp.unpatch(model)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        config=config,
        height=height,
        width=width,
        dtype=str(dtype).removeprefix("torch."),
        model_build_s=build_s,
        eager_ms=med["eager"],
        lossless_ms=med["lossless"],
        ratio=med["lossless"] / med["eager"],
        eager_ms_all=times["eager"],
        lossless_ms_all=times["lossless"],
        bitwise_identical=bool(torch.equal(outs["eager"], outs["lossless"])),
        sites=len(rep.sites),
        # a rotary_emb site runs only where its attention's fused QK norm cannot: 0 calls there is the fast case
        sites_all_fast=all(s.fallback == 0 and (s.fast > 0 or s.op == "rotary_emb") for s in rep.sites),
        report=str(rep).splitlines()[:3],
    )


def conditions():
    commit = os.environ.get("GIT_COMMIT", "")  # for copies of the tree without .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    import diffusers

    return dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        diffusers=diffusers.__version__,
        commit=commit or "unknown",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-dev", choices=["flux-dev", "flux-tiny", "ernie-image", "ernie-image-tiny"])
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--json", help="write all numbers here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)

    t0 = time.perf_counter()
    load_extension()
    result = dict(conditions=conditions(), extension_load_s=time.perf_counter() - t0)
    result["kernels"] = [] if args.skip_kernels else (
        bench_rmsnorm_kernels(dtype) if args.model.startswith("ernie") else bench_kernels(dtype) + bench_rotary_kernels(dtype)
    )
    result["host_us_per_call"] = {} if args.skip_kernels else host_us_per_call(dtype)
    if not args.skip_step:
        result["step"] = bench_step(args.model, args.height, args.width, args.repeats, dtype)

    c = result["conditions"]
    print(f"\n{c['gpu']}, torch {c['torch']} (CUDA {c['cuda']}), diffusers {c['diffusers']}, commit {c['commit']}, {args.dtype}")
    print(f"extension load: {result['extension_load_s']:.1f} s")
    print("\n| op | shape | eager µs | fused µs | speedup | fused GB/s | copy GB/s | % of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["kernels"]:
        print(
            f"| {r['op']} | {tuple(r['shape'])} | {r['eager_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.2f}x | "
            f"{r['fused_GBps']:.0f} | {r['copy_GBps']:.0f} | {r['pct_of_copy']:.0f}% |"
        )
    print("\n| host cost per call | µs |\n|---|---|")
    for k, v in result["host_us_per_call"].items():
        print(f"| {k} | {v:.1f} |")
    if "step" in result:
        s = result["step"]
        print(
            f"\n{s['config']} transformer step at {s['width']}x{s['height']}: eager {s['eager_ms']:.1f} ms, "
            f"lossless {s['lossless_ms']:.1f} ms, ratio {s['ratio']:.3f}; bit-identical: {s['bitwise_identical']}; "
            f"{s['sites']} sites, all on the fast path: {s['sites_all_fast']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
