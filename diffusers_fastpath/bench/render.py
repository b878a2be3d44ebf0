"""The report of a run: markdown tables (what stdout gets) and a PNG bar chart."""

from __future__ import annotations

from typing import Any, Iterable

from .levels.parts import PART_CATEGORIES
from .levels.profile import CATEGORY_NAMES, IDLE_GAP_US, PROFILE_SHOWN
from .levels.vae import vae_markdown
from .runner import violations


def _fmt(v: Any, spec: str = ".1f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return format(v, spec)


def rest_ms(row: dict) -> float:
    """A profiled step's kernel time outside GEMMs, convolutions and attention: what fusion can remove (the removed
    share, against eager's, is the families' goal metric; a compiled mode's kernels that fuse work into its attention
    count there)."""
    c = row["categories"]
    return row["ms"] - sum(c[name]["ms"] for name in FLOOR_CATEGORIES if name in c)


FLOOR_CATEGORIES = ("gemm", "conv", "attention")  # the work fusion leaves as it is (rows of older runs lack "conv")


def _graphs_notes(rows: list[dict]) -> list[str]:
    """One line per CUDA-graphs mode whose step did not replay (a capture failed or calls ran eager): the numbers
    of that row are the eager forward's, and the reader is told why."""
    lines = []
    for r in rows:
        g = (r.get("fastpath") or {}).get("graphs") if r["available"] else None
        if g and (not g["replays"] or g["eager"]):
            eager = "; ".join(f"{reason} ({n})" for reason, n in g["eager"].items()) or "none"
            lines.append(f"{r['mode']}: CUDA graphs {g['status']}, {g['captured']} captured, {g['replays']} replays; "
                         f"eager calls: {eager}")
    return lines + [""] if lines else []


def _peak(row: dict) -> str:
    """The step's peak memory: its timed calls', and its first call's where that was higher (a patched model's first
    forward runs its verification: eager and patched, compared)."""
    peak, first = row["peak_mem_gib"], row.get("first_peak_mem_gib")
    if peak is not None and first is not None and first > peak + 0.005:
        return f"{peak:.2f} (first call {first:.2f})"
    return _fmt(peak, ".2f")


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def nothing_fused(result: dict[str, Any]) -> list[str]:
    """A plain note where the patched modes ran no fused kernel (a CPU, or a machine where the kernels could not be
    had): their time ratios are then noise, not this package's speed-up. Runs saved before ``kernel_calls`` was
    recorded are judged by their device."""
    rows = [r for level in ("step", "generation") for r in result[level]["rows"]
            if r.get("available") and r.get("fastpath")]
    if not rows:
        return []
    calls = [r["fastpath"].get("kernel_calls") for r in rows]
    cpu = not result["conditions"].get("gpu")
    if any(calls) or (None in calls and not cpu):
        return []
    where = ("this run was on a CPU, and the kernels are CUDA-only" if cpu else
             "the kernels could not be had on this machine; the run's warning says why")
    return [f"**No fused kernel ran** ({where}): every patched mode ran diffusers' own eager expressions, so the "
            "time ratios below are noise and Python overhead, not this package's speed-up. Bit-identity is still "
            "checked. Run on a CUDA GPU to measure the speed-up.", ""]


def patched_models(fastpath: dict[str, Any] | None) -> str:
    """The models a mode patched, each with its sites (fast calls / fallbacks), e.g. ``transformer
    (FluxTransformer2DModel) 39 (0/312); vae (AutoencoderKL) 5 (0/10)``; "-" for none."""
    if not fastpath:
        return "-"
    models = fastpath.get("models")
    if not models:  # a run saved before the models were recorded
        return f"{fastpath['sites']} ({fastpath['fast']}/{fastpath['fallback']})"
    return "; ".join(f"{m['name']} ({m['class']}) {m['sites']} ({m['fast']}/{m['fallback']})" for m in models)


def time_split_table(rows: list[dict[str, Any]]) -> list[str]:
    """The generation's time split per mode (`levels.generation.split_parts`): each part's ms and its ratio against
    eager's, with what the text-encoding column means when the pipeline was given prompt embeddings."""
    rows = [r for r in rows if r["available"] and r.get("split")]
    if not rows:
        return []
    first = rows[0]["split"]
    lines = [f"Time split of the call with the median end-to-end time ({first['clock']}; ms, and against eager's; "
             "other: the rest of the call, latents' preparation, unpacking and the image's post-processing):", ""]

    def cell(r: dict[str, Any], part: str) -> str:
        ms, ratio = r["split"][f"{part}_ms"], (r.get("split_ratio") or {}).get(part)
        return "-" if ms is None else f"{ms:.2f}" + (f" ({ratio:.3f}x)" if ratio is not None else "")

    body = []
    for r in rows:
        text = cell(r, "text") if r["split"]["text_encoded"] else (
            "not run" + (f" ({r['split']['text_ms']:.2f})" if r["split"]["text_ms"] is not None else ""))
        body.append([r["mode"], text, cell(r, "denoise"), cell(r, "decode"), cell(r, "other"), cell(r, "total")])
    lines += _table(["mode", "text encoding", "denoising (transformer + scheduler)", "decode (VAE)", "other",
                     "end to end"], body) + [""]
    if not all(r["split"]["text_encoded"] for r in rows):
        lines += ["Text encoding not run: the pipeline was given prompt embeddings (random weights, no text encoder); "
                  "in brackets, the pipeline's `encode_prompt` passing them on.", ""]
    return lines


def describe_conditions(c: dict[str, Any]) -> str:
    hw = f"{c['gpu']} (driver {c['driver'] or 'unknown'})" if c.get("gpu") else f"CPU ({c.get('cpu') or 'unknown'})"
    return (f"{hw}; torch {c['torch']} (CUDA {c['cuda']}), diffusers {c['diffusers']}, diffusers_fastpath "
            f"{c['diffusers_fastpath']}, commit `{c['commit']}`; model {c['model']}, {c['dtype']}, "
            f"{_describe_size(c)}, batch {c['batch']}"
            f"{'; ' + describe_weights(c) if 'quant' in c else ''}; {c['date']}")


def _describe_size(c: dict[str, Any]) -> str:
    """The sample: a zoo model's own size knobs (its published resolution, or its tiny one: ``--height`` and the
    others do not reach it), else ``--width`` x ``--height``, the steps and the text tokens."""
    if c.get("zoo_size") is not None:
        return "inputs " + ", ".join(f"{k}={v}" for k, v in c["zoo_size"].items())
    return f"{c['width']}x{c['height']}, {c['steps']} steps, {c['text_tokens']} text tokens"


def describe_weights(c: dict[str, Any]) -> str:
    """The transformer's weights: the ``--quant`` backend and what the weights hold (runs before ``--quant`` have
    neither)."""
    quant = c.get("quant") or "none"
    held = f", {c['weights_gib']:.3g} GiB" if c.get("weights_gib") is not None else ""
    return f"weights {c['dtype'] if quant == 'none' else quant}{held}"


def _sensors(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The GPU's readings during each mode's timed steps (``--sensors``), or why there are none."""
    sensors = result.get("sensors") or dict(reason="not requested")
    if not sensors.get("ran"):
        return [] if sensors["reason"] == "not requested" else [f"Sensors: {sensors['reason']}.", ""]
    limits = sensors["limits"]
    lines = [f"GPU during the timed steps (NVML, read only, every {sensors['interval_ms']:g} ms; SM clock at most "
             f"{limits['max_sm_mhz']} MHz, power limit {limits['power_limit_w']:.0f} W; capped / thermal: the share of "
             "readings whose clock-event reasons name power capping or heat):", ""]
    body = []
    for r in rows:
        s = r.get("sensors") if r["available"] else None
        if s and s["samples"]:
            body.append([r["mode"], f"{s['sm_mhz_median']:.0f} ({s['sm_mhz_min']})",
                         f"{s['power_w_mean']:.0f} ({s['power_w_max']:.0f})", f"{s['power_capped']:.0%}",
                         f"{s['thermal']:.0%}", str(s["temp_c_max"]), str(s["samples"])])
    lines += _table(["mode", "SM MHz median (min)", "power W mean (max)", "capped", "thermal", "max °C", "readings"],
                    body) + [""]
    if sensors.get("error"):
        lines += [f"The readings stopped early: {sensors['error']}.", ""]
    return lines


def _parts(parts: dict[str, Any] | None) -> list[str]:
    """The parts level's table (`levels.parts`), with the modes it could not record."""
    if not parts or not parts["ran"]:
        return []
    how = "each replayed as one CUDA graph" if parts["graphed"] else "replayed as plain calls (no GPU: wall clock)"
    lines = [f"### The step by parts (one step's recorded ops, {how}; median of {parts['repeats']}, round-robin; "
             "cost: whole minus the step without that part)", ""]
    header = ["mode", "part", "ops (GEMM / GEMV / attention / fused / elementwise)", "ms", "vs eager step", "cost ms",
              "SM MHz", "W"]
    body = []
    for r in parts["rows"]:
        if not r["available"]:
            body.append([r["mode"], r["part"], f"could not replay: {r['reason']}"] + [""] * (len(header) - 3))
            continue
        s = r.get("sensors") or {}
        body.append([r["mode"], r["part"], " / ".join(str(r["ops"][c]) for c in PART_CATEGORIES), _fmt(r["ms"], ".2f"),
                     _fmt(r["vs_eager_step"], ".3f"), _fmt(r["cost_ms"], ".2f"), _fmt(s.get("sm_mhz_median"), ".0f"),
                     _fmt(s.get("power_w_mean"), ".0f")])
    lines += _table(header, body) + [""]
    host = {r["mode"]: r["host_ops_left_out"] for r in parts["rows"] if r["host_ops_left_out"]}
    if host:
        lines += ["Left out of the replay (host-side ops): " + ", ".join(f"{m} {n}" for m, n in host.items()) + ".", ""]
    if parts["skipped"]:
        lines += ["Not recorded: " + "; ".join(f"{m}: {why}" for m, why in parts["skipped"].items()) + ".", ""]
    return lines


def profile_tables(rows: list[dict[str, Any]]) -> list[str]:
    """The profile level's tables for rows of `profile_call` results, each with its ``mode`` (one named "eager" is the
    reference of the "removed" column): kernels by category, the GPU's idle gaps, the costliest kernels per mode."""
    def cell(p: dict, c: str) -> str:
        cat = p["categories"].get(c, {"count": 0, "ms": 0.0})  # a saved run older than a category
        return f"{cat['count']} / {cat['ms']:.2f}"

    lines = []
    header = ["mode", "total", *CATEGORY_NAMES, "outside GEMMs, convolutions and attention: ms (removed)"]
    rest = {p["mode"]: rest_ms(p) for p in rows}
    body = [[p["mode"], f"{p['kernels']} / {p['ms']:.2f}", *(cell(p, c) for c in CATEGORY_NAMES),
             f"{rest[p['mode']]:.2f}" + (f" ({1 - rest[p['mode']] / rest['eager']:.0%})"
                                         if p["mode"] != "eager" and rest.get("eager") else "")]
            for p in rows]
    lines += _table(header, body) + [""]
    idle_rows = [p for p in rows if p.get("idle")]
    if idle_rows:
        lines += [f"GPU idle in the profiled call, between its first and last kernel (under the profiler, "
                  f"whose host overhead lengthens launch-bound gaps; gaps of {IDLE_GAP_US:g} µs or more listed by "
                  "the kernel that waited):", ""]
        lines += _table(["mode", "idle ms", "gaps", "longest waits (kernel: count / ms)"],
                        [[p["mode"], f"{p['idle']['ms']:.2f}", str(p["idle"]["gaps"]),
                          "; ".join(f"`{g['kernel'][:40]}`: {g['count']} / {g['ms']:.2f}"
                                    for g in p["idle"]["by_kernel"][:4])]
                         for p in idle_rows]) + [""]
    for p in rows:
        if p.get("top"):
            shown = p["top"][:PROFILE_SHOWN]
            lines += [f"<details><summary>{p['mode']}: the {len(shown)} kernels that took the most time"
                      + (f" (the JSON keeps {len(p['top'])})" if len(p["top"]) > len(shown) else "") + "</summary>", ""]
            lines += _table(["kernel", "category", "count", "ms"],
                            [[f"`{t['name'][:90]}`", t["category"], str(t["count"]), f"{t['ms']:.2f}"]
                             for t in shown])
            lines += ["", "</details>", ""]
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The report as markdown (what stdout gets, and what ``--from-json`` re-renders)."""
    lines = ["## diffusers_fastpath benchmark", "", describe_conditions(result["conditions"]), ""]
    lines += nothing_fused(result)

    def unavailable(row: dict[str, Any], width: int) -> list[str]:
        return [row["mode"], f"unavailable: {row['reason']}"] + [""] * (width - 2)

    step = result["step"]
    if step["ran"]:
        unit = "GPU ms" if result["conditions"].get("gpu") else "ms"
        weights = f"; {describe_weights(result['conditions'])}" if "quant" in result["conditions"] else ""
        lines += [f"### Transformer step (median of {step['repeats']}, warm-up excluded{weights})", ""]
        header = ["mode", unit, "host ms", "vs eager", "peak GiB", "compile s", "bit-identical", "max abs diff",
                  "PSNR dB", "md5", "fused sites (fast/fallback)"]
        body = []
        for r in step["rows"]:
            if not r["available"]:
                body.append(unavailable(r, len(header)))
                continue
            fpath = r["fastpath"]
            body.append([r["mode"], _fmt(r["ms"], ".2f"), _fmt(r["host_ms"], ".2f"), _fmt(r["ratio"], ".3f"),
                         _peak(r), _fmt(r["compile_s"]), _fmt(r["bit_identical"]),
                         _fmt(r["max_abs_diff"], ".3g"), _fmt(r["psnr_db"], ".1f"), f"`{r['md5'][:10]}`",
                         f"{fpath['sites']} ({fpath['fast']}/{fpath['fallback']})" if fpath else "-"])
        lines += _table(header, body) + [""]
        lines += _graphs_notes(step["rows"])
        if any(not r.get("interleaved", True) for r in step["rows"] if r["available"]):
            lines += ["Compiled modes ran after the others (each after `torch._dynamo.reset()`); the rest ran "
                      "round-robin. Compile s is the first call.", ""]
        lines += _sensors(result, step["rows"])
    gen = result["generation"]
    if gen["ran"]:
        lines += [f"### Generation ({gen['steps']} steps + VAE decode, median of {gen['repeats']}, after a 1-step "
                  "warm-up)", ""]
        header = ["mode", "s", "vs eager", "peak GiB", "compile s", "bit-identical", "PSNR dB", "SSIM",
                  "latents md5", "image md5", "patched: sites (fast/fallback)"]
        body = []
        for r in gen["rows"]:
            if not r["available"]:
                body.append(unavailable(r, len(header)))
                continue
            body.append([r["mode"], _fmt(r["s"], ".3f"), _fmt(r["ratio"], ".3f"), _fmt(r["peak_mem_gib"], ".2f"),
                         _fmt(r["compile_s"]), _fmt(r["bit_identical"]), _fmt(r["psnr_db"], ".1f"),
                         _fmt(r["ssim"], ".4f"), f"`{r['latents_md5'][:10]}`", f"`{r['image_md5'][:10]}`",
                         patched_models(r.get("fastpath"))])
        lines += _table(header, body) + [""]
        lines += _graphs_notes(gen["rows"])
        lines += time_split_table(gen["rows"])
    elif gen["reason"] != "not requested":
        lines += [f"Generation level: {gen['reason']}.", ""]
    prof = result["profile"]
    if prof["ran"] and prof["rows"]:
        lines += [f"### Profile of one step ({prof['rows'][0]['unit']}: count / ms per category)", ""]
        lines += profile_tables(prof["rows"])
    lines += _parts(result.get("parts"))
    kern = result["kernels"]
    if kern["ran"]:
        lines += ["### Fused kernels against their eager chains (inputs rotated past the L2; 40 calls replayed as one "
                  "CUDA graph, so the kernels are timed, not the host's launches: * where a chain could not be captured "
                  "and its launches were timed; GB/s = bytes read + written over time)", ""]
        header = ["op", "shape", "dtype", "eager µs", "fused µs", "speedup", "fused GB/s", "copy GB/s",
                  "% of copy", "equal"]
        body = [[r["op"] + ("" if r.get("graphed", True) else " *"), str(tuple(r["shape"])), r["dtype"],
                 _fmt(r["eager_us"]), _fmt(r["fused_us"]),
                 f"{r['speedup']:.2f}x", _fmt(r["fused_GBps"], ".0f"), _fmt(r["copy_GBps"], ".0f"),
                 f"{r['pct_of_copy']:.0f}%", _fmt(r["equal"])] for r in kern["rows"]]
        if any("calls" in r for r in kern["rows"]):  # recorded from a step (`kernels_recorded`): its calls of each
            header.append("calls / step")
            for row, r in zip(body, kern["rows"]):
                row.append(str(r.get("calls", "")))
            lines += [f"Recorded from one lossless step of this model: {kern.get('note', '')}.", ""]
        lines += _table(header, body) + [""]
        if kern["host_us_per_call"]:
            lines += _table(["host cost per call", "µs"],
                            ([k, f"{v:.1f}"] for k, v in kern["host_us_per_call"].items())) + [""]
    elif kern["reason"] != "not requested":
        lines += [f"Kernels level: {kern['reason']}.", ""]
    lines += vae_markdown(result.get("vae"))
    for call, rows in ((result.get("vae") or {}).get("profile") or {}).items():
        lines += [f"### Profile of one VAE {call} ({rows[0]['unit']}: count / ms per category)", ""]
        lines += profile_tables(rows)
    for v in violations(result):
        lines.append(f"**FAILED: {v}**")
    return "\n".join(lines).rstrip() + "\n"


def import_pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or pip install "
                           "'diffusers_fastpath[plot]')") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict[str, Any], path: str) -> None:
    """A PNG bar chart of time per mode (step and generation), each bar annotated with its ratio to eager and
    whether it is bit-identical."""
    plt = import_pyplot()
    panels = [(level, key, unit) for level, key, unit in (("step", "ms", "ms per step"), ("generation", "s", "s"))
              if result[level]["ran"] and any(r["available"] for r in result[level]["rows"])]
    if not panels:
        raise RuntimeError("nothing to plot: the result has no step or generation timings")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (level, key, unit) in zip(axes[0], panels):
        rows = [r for r in result[level]["rows"] if r["available"]]
        names = [r["mode"] for r in rows]
        values = [r[key] for r in rows]
        colors = ["#4c72b0" if r["bit_identical"] in (True, None) else "#dd8452" for r in rows]
        bars = ax.bar(names, values, color=colors)
        for bar, r in zip(bars, rows):
            exact = "bit-identical" if r["bit_identical"] in (True, None) else (
                f"PSNR {r['psnr_db']:.1f} dB" if isinstance(r["psnr_db"], float) else "not identical")
            ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else ""
            compiled = f"\ncompile {r['compile_s']:.0f} s" if r.get("compile_s") else ""
            ax.annotate(f"{ratio}\n{exact}{compiled}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(level)
        ax.set_ylim(0, max(values) * 1.3)
        ax.tick_params(axis="x", labelrotation=20)
    c = result["conditions"]
    fig.suptitle(f"{c['model']}, {c['dtype']}, {c['width']}x{c['height']}, batch {c['batch']}, {c['steps']} steps - "
                 f"{c.get('gpu') or 'CPU'}, torch {c['torch']}, commit {c['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
