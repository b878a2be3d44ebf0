"""How fast can the exact FLUX.1 kernels be, and where do the step's memsets come from?

The fused kernels must do eager's operations in eager's order; what is free is their layout: threads a row, loads
in flight, vector width. This script builds ``kernel_layout_probe.cu`` (nvcc, for the present GPU) and, at FLUX.1-dev's
shapes, checks every layout variant of the QK norm + rotary and of the LayerNorm + modulate against eager with
``torch.equal`` (outputs poisoned with NaN first) and times it, with the production op and a device-to-device copy of
the same bytes, each as one CUDA graph of calls over inputs rotated past the L2. ``head_norm_rotary_kernel`` in
``csrc/rotary.cu`` came from here (the H200 numbers are in ``docs/results/gpu_session15_0f077e9_aec81f6.txt``).

``v`` checks that the dual blocks' text and image value projections, written by ``torch.addmm(..., out=)`` into the
rows of one joint tensor, equal ``torch.cat`` of the two ``F.linear`` results (a way to drop that concatenation).
``memsets`` profiles one step of a FLUX.1-dev-wide transformer (2 dual + 4 single blocks) eager, lossless and with
CUDA graphs, and names the op and the diffusers line that launched each ``cudaMemsetAsync``.

    python tools/kernel_layout_probe.py [prod] [kernels] [ln] [v] [memsets]   (default: kernels v memsets)

A developer's tool (a CUDA GPU, nvcc and ninja for ``kernels``/``ln``); the log is written to ``$OUT/probe.log``
(default ``/tmp/kernel_layout_probe``).
"""
import argparse
import collections
import importlib
import json
import os
import time

import torch
import torch.nn.functional as F

OUT = os.environ.get("OUT", "/tmp/kernel_layout_probe")
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
dev = torch.device("cuda")
log_lines = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log_lines.append(s)


def flush():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "probe.log"), "w") as f:
        f.write("\n".join(log_lines) + "\n")


def graph_time(fn_list, reps=5):
    """Median µs per call of the calls in fn_list, captured into one CUDA graph (inputs rotate past L2)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_list:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for f in fn_list:
                f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / (4 * len(fn_list)))
    times.sort()
    return times[len(times) // 2]


def build():
    from torch.utils.cpp_extension import load
    t = time.time()
    arch = "".join(map(str, torch.cuda.get_device_capability()))
    mod = load(name="fp_kernel_layout_probe", sources=[os.path.join(here, "kernel_layout_probe.cu")],
               extra_include_paths=[os.path.join(root, "csrc")],
               extra_cuda_cflags=["-O3", "--fmad=false", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"],
               verbose=False)
    log(f"built variants in {time.time() - t:.1f}s")
    return mod


# kernel_layout_probe.cu's variants, by number
ROTARY_VARIANTS = ["8 warps x 32 lanes (the earlier production shape, leaner code)", "4 warps x 32 lanes, 6 slots "
                   "(head_norm_rotary_kernel)", "2 warps x 32 lanes", "6 warps x 16 lanes", "4 warps x 16 lanes",
                   "3 warps x 16 lanes", "2 warps x 16 lanes", "1 warp x 16 lanes", "12 warps x 16 lanes"]
LN_VARIANTS = ["aten's (32, 4) layout", "the same, launch bounds (128, 12)", "the same, (128, 16): spills",
               "64 threads a row, 16-byte loads", "the same, 2 rows a block", "the same, 4 rows a block",
               "persistent, next row in registers, 8 blocks an SM", "the same, 6 blocks an SM",
               "the same, 4 rows a block", "the same, 2 rows a block"]


def rotary_probe(mod):
    q = importlib.import_module("diffusers_fastpath.ops.qk_norm_rope")
    N = 6
    for txt_seq, img_seq in ((512, 4096), (0, 4608), (512, 512), (0, 1024)):
        H, D = 24, 128
        g = torch.Generator(device=dev).manual_seed(txt_seq + img_seq)
        sets = []
        for i in range(N):
            xt = (torch.randn(1, txt_seq, H * D, device=dev, generator=g) * 3).bfloat16().unflatten(-1, (H, D))
            xi = (torch.randn(1, img_seq, H * D, device=dev, generator=g) * 3).bfloat16().unflatten(-1, (H, D))
            sets.append((xt, xi))
        nt = torch.nn.RMSNorm(D, eps=1e-6).to(dev, torch.bfloat16)
        ni = torch.nn.RMSNorm(D, eps=1e-6).to(dev, torch.bfloat16)
        with torch.no_grad():
            nt.weight.copy_(torch.randn(D, device=dev, generator=g) + 1)
            ni.weight.copy_(torch.randn(D, device=dev, generator=g) + 1)
        S = txt_seq + img_seq
        ang = torch.rand(S, D // 2, device=dev, generator=g) * 100
        cos = ang.cos().repeat_interleave(2, -1).contiguous()
        sin = ang.sin().repeat_interleave(2, -1).contiguous()
        outs = [torch.empty(1, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(N)]
        with torch.no_grad():
            xt, xi = sets[0]
            ref = q.qk_norm_rope_ref(nt if txt_seq else None, xt if txt_seq else None, ni, xi, cos, sin)
            prod = q._kernel(q._Norm(nt.weight, nt.eps) if txt_seq else None, xt if txt_seq else None,
                             q._Norm(ni.weight, ni.eps), xi, cos, sin)
            log(f"rotary {txt_seq}+{img_seq}: production equal {torch.equal(prod, ref)}")
            # a plain copy of the same number of bytes: flat buffers
            flat_in = [torch.randn(S * H * D, device=dev).bfloat16() for _ in range(N)]
            flat_out = [torch.empty_like(f) for f in flat_in]
            t_copy = graph_time([lambda a=a, b=b: b.copy_(a) for a, b in zip(flat_in, flat_out)])
            t_prod = graph_time([lambda s=s: q._kernel(q._Norm(nt.weight, nt.eps) if txt_seq else None,
                                                        s[0] if txt_seq else None, q._Norm(ni.weight, ni.eps), s[1],
                                                        cos, sin) for s in sets])
            log(f"  copy {t_copy:.2f} us; production {t_prod:.2f} us ({100 * t_copy / t_prod:.0f}% of copy)")
            for v in range(9 if mod is not None else 0):
                o = outs[0]
                o.fill_(float("nan"))
                xt_ = xt if txt_seq else torch.empty(1, 0, H, D, device=dev, dtype=torch.bfloat16)
                mod.rotary_variant(v, o, xt_, nt.weight, nt.eps, xi, ni.weight, ni.eps, cos, sin)
                eq = torch.equal(o, ref)
                tv = graph_time([lambda o=o, s=s: mod.rotary_variant(
                    v, o, s[0] if txt_seq else xt_, nt.weight, nt.eps, s[1], ni.weight, ni.eps, cos, sin)
                    for o, s in zip(outs, sets)])
                log(f"  variant {v} ({ROTARY_VARIANTS[v]}): equal {eq} {tv:.2f} us ({100 * t_copy / tv:.0f}% of copy)")
    flush()


def ln_probe(mod):
    L = importlib.import_module("diffusers_fastpath.ops.layernorm_scale_shift")
    N = 6
    for rows in (4096, 4608, 512):
        D = 3072
        g = torch.Generator(device=dev).manual_seed(rows)
        xs = [(torch.randn(1, rows, D, device=dev, generator=g) * 4 + 1).bfloat16() for _ in range(N)]
        emb = torch.randn(1, 6 * D, device=dev, generator=g).bfloat16()
        shift, scale = emb.chunk(6, dim=1)[:2]
        norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        outs = [torch.empty_like(x) for x in xs]
        with torch.no_grad():
            ref = L.layernorm_scale_shift_ref(norm, xs[0], scale, shift)
            prod = L._kernel(norm, xs[0], scale, shift)
            log(f"layernorm rows {rows}: production equal {torch.equal(prod, ref)}")
            t_copy = graph_time([lambda a=a, b=b: b.copy_(a) for a, b in zip(xs, outs)])
            t_prod = graph_time([lambda x=x: L._kernel(norm, x, scale, shift) for x in xs])
            log(f"  copy {t_copy:.2f} us; production {t_prod:.2f} us ({100 * t_copy / t_prod:.0f}% of copy)")
            for v in range(len(LN_VARIANTS) if mod is not None else 0):
                o = outs[0]
                o.fill_(float("nan"))
                mod.ln_variant(v, o, xs[0], scale, shift, 1e-6)
                eq = torch.equal(o, ref)
                tv = graph_time([lambda o=o, x=x: mod.ln_variant(v, o, x, scale, shift, 1e-6) for o, x in zip(outs, xs)])
                log(f"  variant {v} ({LN_VARIANTS[v]}): equal {eq} {tv:.2f} us ({100 * t_copy / tv:.0f}% of copy)")
    flush()


def v_into_joint():
    g = torch.Generator(device=dev).manual_seed(5)
    for B in (1,):
        e = torch.randn(B, 512, 3072, device=dev, generator=g).bfloat16()
        x = torch.randn(B, 4096, 3072, device=dev, generator=g).bfloat16()
        lin_e = torch.nn.Linear(3072, 3072).to(dev, torch.bfloat16)
        lin_x = torch.nn.Linear(3072, 3072).to(dev, torch.bfloat16)
        with torch.no_grad():
            ref = torch.cat([lin_e(e), lin_x(x)], 1)
            joint = torch.full((B, 4608, 3072), float("nan"), device=dev, dtype=torch.bfloat16)
            torch.addmm(lin_e.bias, e.view(-1, 3072), lin_e.weight.t(), out=joint.view(-1, 3072)[:512])
            torch.addmm(lin_x.bias, x.view(-1, 3072), lin_x.weight.t(), out=joint.view(-1, 3072)[512:])
            log(f"v into joint (addmm out=) B={B}: equal {torch.equal(joint, ref)}")
    flush()


def memset_sources():
    import diffusers_fastpath as fp
    from diffusers_fastpath.testing.flux import build_flux_transformer, flux_transformer_inputs
    from torch.profiler import ProfilerActivity, profile
    model = build_flux_transformer("flux-dev", device="cuda", num_layers=2, num_single_layers=4)
    inputs = flux_transformer_inputs(model, grid=(64, 64), txt_tokens=512, device=dev)
    for mode in ("eager", "lossless", "graphs"):
        if mode == "lossless":
            fp.patch(model)
        if mode == "graphs":
            fp.unpatch(model)
            fp.patch(model, cuda_graphs=True)
        with torch.inference_mode():
            for _ in range(3):
                model(**inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                model(**inputs)
                torch.cuda.synchronize()
        path = os.path.join("/tmp", f"trace_{mode}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = json.load(f)["traceEvents"]
        kernels = [e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
        memsets = [e for e in ev if e.get("cat") == "gpu_memset"]
        corr = {e["args"].get("correlation"): e for e in ev if e.get("cat") == "cuda_runtime"}
        cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function") and "dur" in e]
        by_tid = collections.defaultdict(list)
        for e in cpu:
            by_tid[e["tid"]].append(e)
        counts = collections.Counter()
        for m in memsets:
            rt = corr.get(m["args"].get("correlation"))
            if rt is None:
                counts[("<no runtime event>",)] += 1
                continue
            enclosing = [e for e in by_tid[rt["tid"]] if e["ts"] <= rt["ts"] <= e["ts"] + e["dur"]]
            enclosing.sort(key=lambda e: e["ts"])
            ops = [e["name"] for e in enclosing if e.get("cat") == "cpu_op"][-3:]
            py = [e["name"] for e in enclosing if e.get("cat") == "python_function"
                  and ("diffusers" in e["name"] or "torch/nn/functional" in e["name"])][-2:]
            counts[(rt["name"], tuple(ops), tuple(py))] += 1
        log(f"memsets {mode}: {len(memsets)} of {len(kernels)} device activities (2 dual + 4 single blocks)")
        for k, n in counts.most_common(12):
            log(f"  {n} x {k}")
        flush()
    fp.unpatch(model)
    del model
    torch.cuda.empty_cache()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", metavar="{prod,kernels,ln,v,memsets}",
                        help="prod: the production ops alone; kernels: build the probe's variants and time the QK norm "
                             "+ rotary and LayerNorm ones; ln: the LayerNorm variants only; v: the value projections "
                             "into the joint tensor; memsets: name the op behind each memset (default: kernels v memsets)")
    what = parser.parse_args().what or ["kernels", "v", "memsets"]
    unknown = sorted(set(what) - {"prod", "kernels", "ln", "v", "memsets"})
    if unknown:
        parser.error(f"unknown part(s): {', '.join(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed: the question is about its kernels")
    log(torch.cuda.get_device_name(), torch.__version__)
    if "prod" in what:
        rotary_probe(None)
        ln_probe(None)
    if "kernels" in what or "ln" in what:
        mod = build()
        if "kernels" in what:
            rotary_probe(mod)
        ln_probe(mod)
    if "v" in what:
        v_into_joint()
    if "memsets" in what:
        memset_sources()
    flush()
