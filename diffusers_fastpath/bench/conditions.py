"""The conditions of a run: hardware, versions, commit and the model's settings, recorded beside every number."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import diffusers_fastpath as fp

from .subject import DTYPES, zoo_knobs


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def commit() -> str:
    """``$GIT_COMMIT`` when set (copies of the tree made for a run elsewhere set it), else ``git rev-parse --short
    HEAD`` (``-dirty`` with uncommitted changes) when the package sits in a git checkout, else ``"unknown"``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = _repo_root()
    if (root / ".git").exists():
        try:
            head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
            if head:
                dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True, timeout=10)
                return head + ("-dirty" if dirty.returncode == 1 else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        try:
            v = torch._C._cuda_getDriverVersion()  # e.g. 12040: the CUDA version the driver supports
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
        except (AttributeError, RuntimeError):
            pass
    return None


def _zoo_size(model: str, knobs: dict[str, int] | None = None) -> dict[str, Any] | None:
    """A ``zoo:`` model's input size knobs (`testing.zoo`: its published resolution, or the tiny defaults), with the
    ``--zoo-size`` ones over them."""
    if not model.startswith("zoo:"):
        return None
    from ..testing import zoo

    entry = zoo.ZOO[model[len("zoo:"):].removesuffix("-tiny")]
    size = {**(entry.full_size if not model.endswith("-tiny") else {}), **(knobs or {})}
    return size or {"size": "tiny"}


def conditions(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Everything a number in the report depends on."""
    import diffusers

    cuda = device.type == "cuda"
    return dict(
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if cuda else None,
        cpu=platform.processor() or platform.machine(),
        driver=_driver_version() if cuda else None,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        diffusers=diffusers.__version__,
        diffusers_fastpath=fp.__version__,
        python=platform.python_version(),
        model=args.model,
        dtype=str(DTYPES[args.dtype]).removeprefix("torch."),
        height=args.height,
        width=args.width,
        steps=args.steps,
        batch=args.batch,
        text_tokens=args.text_tokens,
        quant=args.quant,
        zoo_size=_zoo_size(args.model, zoo_knobs(getattr(args, "zoo_size", []))),
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
