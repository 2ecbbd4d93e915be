"""Shared fixtures: launching real multi-process torchrun jobs (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_torchrun(script: str, nproc: int, args: list[str], timeout: int = 600, nnodes_args=None) -> str:
    """Run ``tests/distributed/workers/<script>`` under ``torchrun --standalone``; fail with its output."""
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(ROOT, "tests", "distributed", "workers", script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


@pytest.fixture
def torchrun():
    return run_torchrun


def read_json(path: str):
    with open(path) as f:
        return json.load(f)
