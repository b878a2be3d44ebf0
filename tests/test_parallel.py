"""diffusers' context parallelism with a patched FLUX transformer (examples/context_parallel.py under torchrun): every
rank `torch.equal` to unpatched diffusers with the same parallel config, patched before or after
``enable_parallelism``. Ulysses runs on a CPU (gloo, two processes); ring attention needs an attention backend that
returns the log-sum-exp, which only CUDA has, and two GPUs (marked ``gpu``, skipped with fewer)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "context_parallel.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_lines(out: str) -> list[str]:
    """Each rank's verdict (found anywhere: two processes share the pipe)."""
    return re.findall(r"rank \d+: [^\n]*?bit-identical: (?:True|False)(?:, [^\n]*?bit-identical: (?:True|False))*", out)


def torchrun(*args: str, nproc: int = 2) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(SCRIPT), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.parametrize("order", ["before", "after"])
def test_ulysses_on_cpu_every_rank_bit_identical(order):
    out = torchrun("--order", order)
    lines = rank_lines(out)
    assert len(lines) == 2 and all(f"patched {order} enable_parallelism: patched CP bit-identical: True" in line
                                   for line in lines), out
    assert "quality=lossless; 40 fused sites" in out  # rank 0's report: the patched model ran its sites


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", [[], ["--ring"]], ids=["ulysses", "ring"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_flux_dev_on_two_gpus_bit_identical_with_graphs(mode, order):
    out = torchrun("--device", "cuda", "--model", "flux-dev", "--order", order, "--steps", "5", *mode)
    lines = rank_lines(out)
    assert len(lines) == 2 and all("patched CP bit-identical: True, patched CP + graphs bit-identical: True" in line
                                   for line in lines), out
    assert "fallbacks" in out and " 0 fallbacks;" in out, out  # every fused site fast on the sharded sequence
