"""`report`: what is patched, which op each site uses, and how many calls took the fast path or fell back; the
quality tier of each model and, per high-tier site, whether it is mounted and how many calls took the approximate
path."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .graphs import GRAPHS_ATTR
from .models._rope_cache import STATS_PREFIX
from .ops import OPS, _build
from ._state import patched_models, sites_of
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
    caches: dict[str, dict[str, int]]  # e.g. {"rotary_cache": {"built": 1, "reused": 27}}
    notes: list[str]
    # with cuda_graphs=True: status, captured signatures, replays, captures, invalidations, eager calls by reason,
    # pool_mib (the graphs' shared memory pool), static_inputs_mib; empty otherwise
    graphs: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_built(self) -> int | None:
        return self.caches.get("rotary_cache", {}).get("built")

    @property
    def rope_reused(self) -> int | None:
        return self.caches.get("rotary_cache", {}).get("reused")


@dataclass
class Report:
    """Printable (``print(report)``) and machine-readable (`to_dict`) state of the fast path."""

    models: list[ModelRow] = field(default_factory=list)
    sites: list[SiteRow] = field(default_factory=list)
    # high-tier sites: ``fast`` counts calls on the approximate path, ``fallback`` calls sent to the lossless path
    tier_sites: list[SiteRow] = field(default_factory=list)
    ops: dict[str, str] = field(default_factory=dict)
    extension: str = "not loaded"

    @property
    def fast(self) -> int:
        return sum(s.fast for s in self.sites)

    @property
    def fallback(self) -> int:
        return sum(s.fallback for s in self.sites)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = []
        for m in self.models:
            caches = "".join(
                f", {name.replace('_', ' ')}: built {c['built']}, reused {c['reused']}" for name, c in m.caches.items()
            )
            lines.append(f"{m.name} ({m.cls}): quality={m.quality}, fastpath attention processors={m.processors}{caches}")
            lines += [f"  note: {n}" for n in m.notes]
            if m.graphs:
                g = m.graphs
                eager = ", ".join(f"{r}: {n}" for r, n in g["eager"].items()) or "none"
                lines.append(
                    f"  cuda graphs: {g['status']}; {g['captured']} captured, {g['replays']} replays, pool "
                    f"{g['pool_mib']} MiB + {g['static_inputs_mib']} MiB static inputs; eager calls: {eager}"
                )
        lines.append("ops: " + "; ".join(f"{k} {v}" for k, v in self.ops.items()) + f"; CUDA extension {self.extension}")
        reasons = lambda s: ", ".join(f"{r}: {n}" for r, n in s.reasons.items()) or "-"  # noqa: E731
        header = ("site", "op", "fast", "fallback", "fallback reasons")
        rows = [(f"{s.model}.{s.site}", s.op, str(s.fast), str(s.fallback), reasons(s)) for s in self.sites]
        rows.append(("total", "", str(self.fast), str(self.fallback), ""))
        lines += _table(header, rows)
        if self.tier_sites:
            header = ("high-tier site", "op", "mounted", "approximate", "lossless", "lossless reasons")
            rows = [
                (f"{s.model}.{s.site}", s.op, "yes" if s.mounted else f"cannot: {s.cannot}" if s.cannot else "no",
                 str(s.fast), str(s.fallback), reasons(s))
                for s in self.tier_sites
            ]
            lines += _table(header, rows)
        return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows)]


def report(obj: Any) -> Report:
    """Per fusion site: the op it uses, calls on the fast path, fallbacks and their reasons.

    ``quality`` of each model row is its current tier; ``tier_sites`` lists the high-tier sites (mounted or not,
    calls on the approximate path, calls sent to the lossless path and why), and a model's notes say which sites
    cannot take their fusion.

    Args:
        obj: a pipeline or model given to `patch` (an unpatched one gives an empty report).

    Returns:
        A `Report`; ``print(report(pipe))`` shows it as a table, ``report(pipe).to_dict()`` as plain data.

    Example:
        >>> print(fp.report(pipe))  # doctest: +SKIP
    """
    rep = Report(ops={name: op.status for name, op in OPS.items()})
    if _build.load_seconds is not None:
        rep.extension = f"{'built' if _build.cold_build else 'loaded'} in {_build.load_seconds:.1f} s"
    for name, model, state in patched_models(obj):
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
