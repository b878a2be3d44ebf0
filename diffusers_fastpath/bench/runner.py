"""One benchmark run: every mode at every level requested, exactness checked against eager (`run`, `violations`)."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from .._logging import logger
from .conditions import conditions
from .levels.generation import generation_once, generation_row
from .levels.kernels import KERNEL_FAMILIES, run_kernels
from .levels.kernels_recorded import run_recorded
from .levels.parts import run_parts
from .levels.profile import profile_step
from .levels.step import step_once, step_row
from .levels.vae import run_vae
from .modes import MODES, Context, Mode, applied
from .quant import weights_gib
from .sensors import INTERVAL_S, Sensors
from .subject import Subject, build_subject, generate
from .timing import Clock, Samples, progress

SCHEMA = 1
LEVELS = ("step", "generation", "profile", "parts", "kernels", "vae")


def round_robin(modes: list[Mode], rounds: int, model: nn.Module, ctx: Context, body: Callable[[Mode, int], None],
                apply: bool = True) -> None:
    """``body(mode, round)`` for every round and mode in turn, each mode applied around its own call (unless the
    caller already applied the single mode it passes)."""
    for r in range(rounds):
        for mode in modes:
            if apply:
                with applied(mode, model, ctx):
                    body(mode, r)
            else:
                body(mode, r)


def _unavailable_row(name: str, reason: str) -> dict[str, Any]:
    return dict(mode=name, available=False, reason=reason)


class _Runner:
    """One benchmark run: the subject, the clock, and what each mode gave at each level."""

    def __init__(self, args: argparse.Namespace, subject: Subject, ctx: Context, modes_info: dict[str, dict],
                 sensors: Sensors | None = None) -> None:
        self.args, self.subject, self.ctx, self.modes_info = args, subject, ctx, modes_info
        # the generation level patches the pipeline whole (`modes.Context.pipe`: its VAE too), as a user does
        pipe = subject.pipe if subject is not None else None
        self.gen_ctx = dataclasses.replace(ctx, pipe=pipe) if pipe is not None else ctx
        self.device = ctx.device
        self.clock = Clock(ctx.device, sensors)
        self.show = not args.no_progress and sys.stderr.isatty()
        self.step: dict[str, Samples] = {}
        self.gen: dict[str, Samples] = {}
        self.prof: dict[str, dict] = {}
        self.phases: dict[str, float] = {}

    def phase(self, name: str, t0: float) -> None:
        self.phases[name] = time.perf_counter() - t0
        print(f"[bench] {name}: {self.phases[name]:.1f} s", file=sys.stderr, flush=True)

    def failed(self, mode: Mode, exc: Exception) -> None:
        reason = f"failed: {type(exc).__name__}: {exc}".strip()
        logger.warning(f"diffusers_fastpath.bench: mode {mode.name} {reason}")
        self.modes_info[mode.name].update(available=False, reason=reason)
        for level in (self.step, self.gen, self.prof):
            level.pop(mode.name, None)

    def probe(self, modes: list[Mode], ctx: Context) -> list[Mode]:
        """The modes that apply (to the pipeline where `ctx` holds it) and run one step; the others are reported as
        failed, with the error."""
        ok = []
        for mode in modes:
            try:
                with applied(mode, self.subject.transformer, ctx):
                    self.clock.time(self.subject.step)
            except Exception as exc:  # noqa: BLE001 - one broken mode must not cost the whole run
                self.failed(mode, exc)
            else:
                ok.append(mode)
        return ok

    def plain_modes(self, modes: list[Mode], do_step: bool, do_gen: bool, do_prof: bool) -> None:
        """Every non-compiled mode, round-robin: each applied around each of its calls."""
        subject, clock, args = self.subject, self.clock, self.args
        if do_step or do_prof:
            t0 = time.perf_counter()
            if do_step:
                with progress(args.repeats * len(modes), "step", self.show) as bar:
                    def body(mode: Mode, r: int) -> None:
                        step_once(subject, clock, self.step.setdefault(mode.name, Samples()))
                        bar.update()

                    round_robin(modes, args.repeats, subject.transformer, self.ctx, body)
            if do_prof:
                for mode in modes:
                    with applied(mode, subject.transformer, self.ctx):
                        clock.time(subject.step)
                        self.prof[mode.name] = profile_step(subject, clock)
            self.phase("step", t0)
        if do_gen:
            t0 = time.perf_counter()
            with progress(args.gen_repeats * len(modes), "generation", self.show) as bar:
                def body(mode: Mode, r: int) -> None:
                    generation_once(subject, args, self.device, clock, self.gen.setdefault(mode.name, Samples()))
                    bar.update()

                round_robin(modes, args.gen_repeats, subject.transformer, self.gen_ctx, body)
            self.phase("generation", t0)

    def compiled_mode(self, mode: Mode, do_step: bool, do_gen: bool, do_prof: bool) -> None:
        """One compiled mode, after ``torch._dynamo.reset()``: its first call is the compile time, then each level."""
        subject, clock, args = self.subject, self.clock, self.args
        t0 = time.perf_counter()
        torch._dynamo.reset()
        try:
            with applied(mode, subject.transformer, self.gen_ctx if do_gen else self.ctx):
                c0 = time.perf_counter()
                if do_step or do_prof:
                    subject.step()
                else:
                    generate(subject, args, self.device, steps=1)
                clock.sync()
                compile_s = time.perf_counter() - c0
                print(f"[bench] {mode.name}: compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)
                if do_step:
                    samples = self.step[mode.name] = Samples(compile_s=compile_s)
                    with progress(args.repeats, f"step {mode.name}", self.show) as bar:
                        for _ in range(args.repeats):
                            step_once(subject, clock, samples)
                            bar.update()
                if do_prof:
                    self.prof[mode.name] = profile_step(subject, clock)
                if do_gen:
                    samples = self.gen[mode.name] = Samples(compile_s=None if (do_step or do_prof) else compile_s)
                    for _ in range(args.gen_repeats):
                        generation_once(subject, args, self.device, clock, samples)
        except Exception as exc:  # noqa: BLE001 - e.g. a backend that cannot compile this model here
            self.failed(mode, exc)
        finally:
            torch._dynamo.reset()
        self.phase(mode.name, t0)

    def rows(self, samples: dict[str, Samples], make_row) -> list[dict[str, Any]]:
        ref = samples.get("eager")
        out = []
        for name, info in self.modes_info.items():
            if not info["available"]:
                out.append(_unavailable_row(name, info["reason"]))
            elif name in samples:
                out.append(make_row(MODES[name], samples[name], ref))
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the arguments describe; returns the JSON-able result."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # CUDA events and the kernels level use the current device
    levels = args.levels
    ctx = Context(device, {k: v for k, v in (("backend", args.compile_backend), ("mode", args.compile_mode)) if v})
    modes_info = {}
    for name in args.modes:
        mode = MODES[name]
        reason = mode.unavailable(ctx)
        modes_info[name] = dict(description=mode.description, exact=mode.exact, compiled=mode.compiled,
                                available=reason is None, reason=reason)
    result: dict[str, Any] = dict(schema=SCHEMA, conditions=conditions(args, device), args=vars(args).copy(),
                                  levels=levels, modes=modes_info)

    t0 = time.perf_counter()
    need_pipe = "generation" in levels
    # the VAE level builds its own VAE: a run of it alone builds no transformer (with the profile level, it profiles
    # the VAE's calls)
    vae_only = "vae" in levels and set(levels) <= {"vae", "profile"}
    subject = None if vae_only else build_subject(args, device, need_pipe)
    result["conditions"]["weights_gib"] = weights_gib(subject.transformer) if subject is not None else None
    wanted = getattr(args, "sensors", False)
    sensors, why_not = Sensors.open(device) if wanted else (None, "not requested")
    if wanted and sensors is None:
        logger.warning(f"diffusers_fastpath.bench: --sensors: {why_not}; the run goes on without readings")
    result["sensors"] = dict(ran=sensors is not None, reason=why_not, interval_ms=INTERVAL_S * 1e3,
                             limits=sensors.limits if sensors is not None else None)
    runner = _Runner(args, subject, ctx, modes_info, sensors)
    runner.phase("build", t0)
    do_step, do_prof, do_parts = "step" in levels, "profile" in levels and not vae_only, "parts" in levels
    do_gen = need_pipe and subject.no_generation is None

    result["parts"] = dict(ran=False, reason="not requested", rows=[], skipped={})
    with torch.no_grad():
        if do_step or do_gen or do_prof or do_parts:
            for _ in range(2):  # the process's first calls (allocator, cuBLAS handles, ...) count for no mode
                runner.clock.time(subject.step)
            available = [MODES[name] for name, info in modes_info.items() if info["available"]]
            plain = runner.probe([m for m in available if not m.compiled], runner.gen_ctx if do_gen else ctx)
            if "eager" not in [m.name for m in plain]:
                raise RuntimeError(f"the eager reference failed: {modes_info['eager']['reason']}")
            runner.plain_modes(plain, do_step, do_gen, do_prof)
            for mode in available:
                if mode.compiled:
                    runner.compiled_mode(mode, do_step, do_gen, do_prof)
            if do_parts:
                t0 = time.perf_counter()
                eager = runner.step.get("eager")
                now = [MODES[name] for name, info in modes_info.items() if info["available"]]
                result["parts"] = run_parts(now, subject, runner.clock, ctx, args.repeats,
                                            statistics.median(eager.ms) if eager is not None else None)
                runner.phase("parts", t0)

    result["step"] = dict(ran=do_step, reason=None if do_step else "not requested", repeats=args.repeats,
                          rows=runner.rows(runner.step, step_row) if do_step else [])
    gen_reason = None if do_gen else ("not requested" if not need_pipe else subject.no_generation)
    result["generation"] = dict(ran=do_gen, reason=gen_reason, repeats=args.gen_repeats, steps=args.steps,
                                rows=runner.rows(runner.gen, generation_row) if do_gen else [])
    result["profile"] = dict(ran=do_prof, reason=None if do_prof else "not requested",
                             rows=[dict(mode=name, **p) for name, p in runner.prof.items()])
    if "kernels" in levels:
        t0 = time.perf_counter()
        with torch.no_grad():
            # hand-written cases for six families; every other model's from one lossless step of its own
            run = run_kernels if subject.family in KERNEL_FAMILIES else run_recorded
            result["kernels"] = run(subject, args, device, runner.show)
        runner.phase("kernels", t0)
    else:
        result["kernels"] = dict(ran=False, reason="not requested", rows=[], host_us_per_call={})
    if "vae" in levels:
        t0 = time.perf_counter()
        with torch.no_grad():
            result["vae"] = run_vae(args, device, runner.show, profile="profile" in levels)
        runner.phase("vae", t0)
    else:
        result["vae"] = dict(ran=False, reason="not requested", rows=[])
    if sensors is not None:
        sensors.close()
        result["sensors"]["error"] = sensors.error
    result["phases_s"] = runner.phases
    return result


def violations(result: dict[str, Any]) -> list[str]:
    """What broke a promise: a mode that promises bit-identity and is not, a fused kernel unequal to its chain."""
    out = []
    for level in ("step", "generation"):
        for row in result[level]["rows"]:
            if row.get("available") and result["modes"][row["mode"]]["exact"] and row["bit_identical"] is False:
                out.append(f"{level}: mode {row['mode']} is not bit-identical to eager")
    for row in result["kernels"]["rows"]:
        if row.get("exact", True) and not row["equal"]:
            out.append(f"kernels: {row['op']} {tuple(row['shape'])} is not equal to its eager chain")
    for row in result.get("vae", {}).get("rows", []):
        if not row["bit_identical"]:
            out.append(f"vae: the patched {row['call']} is not bit-identical to eager")
    return out
