"""Shared fixtures: launching real multi-process jobs (torchrun, or forked gloo ranks) on CPU, and a
world of one for in-process tests of megatron models."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Callable

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


def run_torchrun_runs(worker: str, nproc: int, runs: list[list[str]], timeout: int = 600) -> str:
    """Run ``worker`` (a module of tests/distributed/workers) once per argument list of ``runs``, all in
    one torchrun launch of ``nproc`` processes (workers/runs.py): one process start for all of them."""
    argv = [arg for i, args in enumerate(runs) for arg in ([] if i == 0 else ["--then"]) + args]
    return run_torchrun("runs.py", nproc, [worker, *argv], timeout=timeout)


def run_forked_ranks(worker: Callable[[int, str, str], None], tmp_path, nproc: int = 2) -> None:
    """Run ``worker(rank, init_file, out_dir)`` in ``nproc`` forked processes (a gloo group through
    ``file://init_file``); every rank must exit 0 within 60 s. Results go to files in ``out_dir``."""
    ctx = mp.get_context("fork")
    init_file, out_dir = str(tmp_path / "store"), str(tmp_path)
    procs = [ctx.Process(target=worker, args=(r, init_file, out_dir)) for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * nproc


@pytest.fixture
def torchrun():
    return run_torchrun


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def single_ps(dp_rank: int = 0):
    """A hand-built ParallelState of one CPU process, no process groups (nothing to gather or
    broadcast: the rank leads its replica); ``dp_rank``: the data-parallel replica it speaks for."""
    import torch

    from megatron_rl.parallel import ParallelState

    return ParallelState(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo",
        tp_size=1, pp_size=1, dp_size=dp_rank + 1, tp_rank=0, pp_rank=0, dp_rank=dp_rank,
        tp_group=None, pp_group=None, dp_group=None, mp_group=None, embedding_group=None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ps():
    """A world of one (gloo) with megatron's groups: DP = TP = PP = 1, no collectives to speak of."""
    from megatron_rl.parallel import destroy_parallel, init_parallel

    environ = dict(os.environ)  # init_parallel sets RANK/WORLD_SIZE/MASTER_*: keep them from later tests
    state = init_parallel(1, 1, seed=0, device="cpu")
    yield state
    destroy_parallel()
    os.environ.clear()
    os.environ.update(environ)
