"""The package's own structure: its imports form a DAG (no module imports one that imports it back, also lazily
inside a function), with ``_state`` <- ``quality`` <- ``models`` <- ``patching``; and each warning is printed once
per process (issue 12: the CUDA-graphs warning was printed 12 times by one bench run)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import diffusers_fastpath as fp
from diffusers_fastpath import _logging
from diffusers_fastpath.testing import build_flux_transformer

PACKAGE = Path(fp.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports anywhere (top level or inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_package_imports_form_a_dag():
    graph = _imports()
    assert {"diffusers_fastpath._state", "diffusers_fastpath.quality", "diffusers_fastpath.patching"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _reaches(graph, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += graph[node]
    return False


@pytest.mark.parametrize(
    "lower, upper",
    [("_state", "quality"), ("quality", "models"), ("models", "patching"), ("_state", "patching")],
)
def test_the_shared_state_sits_below_its_users(lower, upper):
    graph = _imports()
    lower, upper = f"diffusers_fastpath.{lower}", f"diffusers_fastpath.{upper}"
    assert _reaches(graph, upper, lower) and not _reaches(graph, lower, upper)


def test_each_warning_is_printed_once_per_process(fastpath_log, monkeypatch, unpatch_after):
    """Patching several models with cuda_graphs=True on a machine without CUDA (what one bench run does) says that
    graphs have no effect once."""
    monkeypatch.setattr(_logging, "_warned", set())  # this process may have warned already, in another test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for seed in range(3):
        model = build_flux_transformer("flux-tiny", torch.float32, seed=seed)
        fp.patch(model, cuda_graphs=True)
        unpatch_after(model)
    lines = [r.getMessage() for r in fastpath_log.records if r.levelno >= logging.WARNING and "cuda_graphs" in r.getMessage()]
    assert lines == ["diffusers_fastpath: cuda_graphs=True has no effect on FluxTransformer2DModel: CUDA is not available; it runs eager"]
    _logging.warn_once("another message")
    _logging.warn_once("another message")
    assert sum(r.getMessage() == "another message" for r in fastpath_log.records) == 1


def test_every_subpackage_is_installed():
    """pyproject.toml lists its packages by hand: a subpackage missing there is left out of a (non-editable) install."""
    import tomllib

    pyproject = PACKAGE.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("installed without its source tree")
    listed = set(tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
