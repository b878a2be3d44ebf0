"""`report`: what is patched, which op each site uses, and how many calls took the fast path or fell back; the
quality tier of each model and, per high-tier site, whether it is mounted and how many calls took the approximate
path."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .graphs import GRAPHS_ATTR
from .models._rope_cache import STATS_PREFIX
from .ops import OPS, _build
from . import postprocess, verify
from ._state import is_pipeline, models_in, patched_models, sites_of
from .patching import _models_of
from .quality import tier_sites


@dataclass
class SiteRow:
    model: str
    site: str
    module: str
    op: str
    fast: int
    fallback: int
    reasons: dict[str, int]
    mounted: bool | None = None  # high-tier sites: whether the approximate fusion is on (None: a lossless site)
    cannot: str | None = None  # high-tier sites: why the module cannot take the fusion



@dataclass
class ModelRow:
    name: str
    cls: str
    quality: str
    processors: int  # attention processors of this package in use
    caches: dict[str, dict[str, int]]  # e.g. {"rotary_cos_sin": {"built": 1, "reused": 71}}
    notes: list[str]
    # with cuda_graphs=True: status, captured signatures, replays, captures, invalidations, eager calls by reason,
    # pool_mib (the graphs' shared memory pool), static_inputs_mib; empty otherwise
    graphs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """Printable (``print(report)``) and machine-readable (`to_dict`) state of the fast path.

    ``str(report)`` leads with the kernels' status and one summary per model (sites fast / fallback per op, the
    fallback reasons, the tier, CUDA graphs); with ``verbose=True`` it adds every op's status and the table of every
    site. Nothing is printed until you print it.
    """

    models: list[ModelRow] = field(default_factory=list)
    sites: list[SiteRow] = field(default_factory=list)
    # high-tier sites: ``fast`` counts calls on the approximate path, ``fallback`` calls sent to the lossless path
    tier_sites: list[SiteRow] = field(default_factory=list)
    ops: dict[str, str] = field(default_factory=dict)
    kernels: str = ""  # one line: where the CUDA kernels come from, or why there are none (`kernels_line`)
    not_patched: str | None = None  # the one line shown for an object with nothing patched
    verbose: bool = False
    # a pipeline whose ``video_processor.postprocess_video`` or ``image_processor.postprocess`` is this package's
    # (`postprocess`): their calls (one counter for both),
    # process-wide, {"fast": n, "fallback": {reason: n}}; empty otherwise
    postprocess: dict[str, Any] = field(default_factory=dict)

    @property
    def fast(self) -> int:
        return sum(s.fast for s in self.sites)

    @property
    def fallback(self) -> int:
        return sum(s.fallback for s in self.sites)

    @property
    def kernel_calls(self) -> int:
        """Fast calls that ran a fused kernel (not counting sites whose fast path is no kernel, e.g. a view)."""
        return sum(s.fast for s in self.sites if s.op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.not_patched is not None:
            return self.not_patched
        lines = [f"diffusers_fastpath: {self.kernels}"]
        for m in self.models:
            lines += _model_summary(m, [s for s in self.sites if s.model == m.name],
                                    [s for s in self.tier_sites if s.model == m.name])
        if self.postprocess:
            lines.append(f"image/video post-processing (pinned copy, process-wide): {self.postprocess['fast']} fast "
                         f"calls, fallbacks: {_reasons(self.postprocess['fallback'])}")
        if not self.verbose:  # the ops that are not simply on, else one word
            unusual = {k: v for k, v in self.ops.items() if v != "enabled" and not v.startswith("enabled,")}
            lines.append("ops: " + ("; ".join(f"{k} {v}" for k, v in unusual.items()) if unusual else "all enabled"))
            lines.append("(print(fp.report(obj, verbose=True)) lists every site)")
            return "\n".join(lines)
        lines.append("ops: " + "; ".join(f"{k} {v}" for k, v in self.ops.items()))
        header = ("site", "op", "fast", "fallback", "fallback reasons")
        rows = [(f"{s.model}.{s.site}", s.op, str(s.fast), str(s.fallback), _reasons(s.reasons)) for s in self.sites]
        rows.append(("total", "", str(self.fast), str(self.fallback), ""))
        lines += _table(header, rows)
        if self.tier_sites:
            header = ("high-tier site", "op", "mounted", "approximate", "lossless", "lossless reasons")
            rows = [
                (f"{s.model}.{s.site}", s.op, "yes" if s.mounted else f"cannot: {s.cannot}" if s.cannot else "no",
                 str(s.fast), str(s.fallback), _reasons(s.reasons))
                for s in self.tier_sites
            ]
            lines += _table(header, rows)
        return "\n".join(lines)


def _reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{r}: {n}" for r, n in reasons.items()) or "-"


def _model_summary(m: ModelRow, sites: list[SiteRow], tier_sites: list[SiteRow]) -> list[str]:
    """A few lines per model: totals, then one row per op, the tier and the graphs."""
    fast, fallback = sum(s.fast for s in sites), sum(s.fallback for s in sites)
    caches = "".join(
        f", {name.replace('_', ' ')}: built {c['built']}, reused {c['reused']}" for name, c in m.caches.items()
    )
    lines = [
        f"{m.name} ({m.cls}): quality={m.quality}; {len(sites)} fused sites, {fast} fast calls, {fallback} fallbacks; "
        f"fastpath attention processors={m.processors}{caches}"
    ]
    per_op: dict[str, list] = {}
    for s in sites:
        row = per_op.setdefault(s.op, [0, 0, 0, {}])
        row[0] += 1
        row[1] += s.fast
        row[2] += s.fallback
        for reason, n in s.reasons.items():
            row[3][reason] = row[3].get(reason, 0) + n
    if per_op:
        header = ("op", "sites", "fast", "fallback", "fallback reasons")
        lines += ["  " + line for line in _table(header, [
            (op, str(n), str(f), str(b), _reasons(r)) for op, (n, f, b, r) in per_op.items()
        ])]
    if tier_sites:
        mounted = sum(bool(s.mounted) for s in tier_sites)
        approx = sum(s.fast for s in tier_sites)
        lines.append(f"  high tier: {mounted} of {len(tier_sites)} sites mounted, {approx} approximate calls")
    lines += [f"  note: {n}" for n in m.notes]
    if m.graphs:
        g = m.graphs
        eager = ", ".join(f"{r}: {n}" for r, n in g["eager"].items()) or "none"
        lines.append(
            f"  cuda graphs: {g['status']}; {g['captured']} captured, {g['replays']} replays, pool "
            f"{g['pool_mib']} MiB + {g['static_inputs_mib']} MiB static inputs; eager calls: {eager}"
        )
    return lines


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows)]


def _not_patched_line(obj: Any) -> str:
    failed = [f"{type(m).__name__}: {why}" for _, m in models_in(obj) if m in verify.FAILED
              for why in (verify.FAILED[m],)] if _is_model_or_pipeline(obj) else []
    if failed:
        return "diffusers_fastpath: " + "; ".join(failed)
    return _not_patched_line_plain(obj)


def _is_model_or_pipeline(obj: Any) -> bool:
    try:
        models_in(obj)
    except TypeError:
        return False
    return True


def _not_patched_line_plain(obj: Any) -> str:
    from .patching import supported_classes

    what = type(obj).__name__
    supported = ", ".join(supported_classes())
    try:
        models = _models_of(obj, for_patch=True)
    except TypeError:  # UnsupportedModelError, or neither a pipeline nor a model
        return f"diffusers_fastpath: {what} is not supported (supported: {supported}); nothing is patched."
    names = ", ".join(f"{name} ({type(model).__name__})" for name, model in models)
    return f"diffusers_fastpath: {what} is not patched ({names}); call diffusers_fastpath.patch on it first."


def kernels_line() -> str:
    """The report's first line (after ``diffusers_fastpath: ``): where this process's CUDA kernels come from, or why
    none run. Before any fused op has asked for the kernels the loader can only say "not loaded"; on a machine
    without a CUDA device they never will load, and that is said plainly instead."""
    if _build.load_seconds is not None or torch.cuda.is_available():
        return _build.kernels_status()
    # no CUDA device: said the same way whether or not something asked the loader before (it then failed for this)
    why = "this build of torch has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
    return (f"no CUDA kernels run here ({why}; torch {torch.__version__}): every fused site runs diffusers' eager "
            "expression, the same numbers with no speed-up")


def report(obj: Any, verbose: bool = False) -> Report:
    """What the fast path did: the kernels' status, and per model the sites fast / falling back per op and why.

    ``quality`` of each model row is its current tier; ``tier_sites`` lists the high-tier sites (mounted or not,
    calls on the approximate path, calls sent to the lossless path and why), and a model's notes say which sites
    cannot take their fusion. An object with nothing patched gives a report that says so in one line.

    It returns the report and prints nothing itself: ``print(fp.report(pipe))`` shows it.

    Args:
        obj: a pipeline or model given to `patch`.
        verbose: make the printed form (``str``) list every op's status and every site in a table, not only the
            summary per model (the data, ``to_dict()``, is the same either way).

    Returns:
        A `Report`; ``print(report(pipe))`` shows the summary, ``report(pipe).to_dict()`` the data.

    Example:
        >>> print(fp.report(pipe))  # doctest: +SKIP
        >>> print(fp.report(pipe, verbose=True))  # doctest: +SKIP
    """
    rep = Report(ops={name: op.status for name, op in OPS.items()}, kernels=kernels_line(), verbose=verbose)
    models = patched_models(obj) if _is_model_or_pipeline(obj) else []  # (anything else: a line saying so)
    if not models:
        rep.not_patched = _not_patched_line(obj)
    elif is_pipeline(obj) and postprocess.installed_on(obj):
        rep.postprocess = {"fast": postprocess.STATS.fast, "fallback": dict(postprocess.STATS.fallback)}
    for name, model, state in models:
        processors = 0
        caches: dict[str, dict[str, int]] = {}
        for site_name, module in model.named_modules():
            for label, site in sites_of(module):
                path = site_name if label is None else f"{site_name}:{label}"
                rep.sites.append(
                    SiteRow(name, path, type(module).__name__, site.op, site.fast, sum(site.fallback.values()), dict(site.fallback))
                )
            if type(getattr(module, "processor", None)).__module__.startswith(__package__):
                processors += 1
            for attr, stats in module.__dict__.items():
                if attr.startswith(STATS_PREFIX):
                    caches[attr[len(STATS_PREFIX):]] = {"built": stats.built, "reused": stats.reused}
        notes = list(state.notes)
        if getattr(state, "verifier", None) is not None:  # the generic path's model-level check
            notes += state.verifier.notes()
        cannot: dict[str, int] = {}
        for site_name, module, site in tier_sites(model):
            c = site.counters
            rep.tier_sites.append(
                SiteRow(name, site_name, type(module).__name__, site.op, c.fast, sum(c.fallback.values()),
                        dict(c.fallback), site.mounted, site.cannot)
            )
            if site.cannot is not None:
                cannot[site.cannot] = cannot.get(site.cannot, 0) + 1
        notes += [f"{n} high-tier site(s) cannot take their fusion and run the lossless path: {why}"
                  for why, n in cannot.items()]
        runner = model.__dict__.get(GRAPHS_ATTR)
        graphs = runner.stats() if runner is not None else {}
        rep.models.append(ModelRow(name, type(model).__name__, state.quality, processors, caches, notes, graphs))
    return rep
