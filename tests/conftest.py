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


def run_torchrun(
    script: str, nproc: int, args: list[str], timeout: int = 600, nnodes_args=None, real: bool = False
) -> str:
    """Run ``tests/distributed/workers/<script>`` as ``nproc`` ranks of one launch; fail with its output,
    else return the ranks' stdout (rank by rank). The ranks are forked from the session's zygote
    (tests/zygote.py: the environment torchrun gives, without its start-up); ``real`` (or
    ``nnodes_args``) launches them under ``torchrun --standalone`` for what torchrun itself does
    (MEGATRON_RL_TESTS_TORCHRUN=1: every launch, to compare). Each launch gets a job secret of its own,
    as launch/torchrun.sh gives (roles on ranks of their own sign their messages with it)."""
    import secrets

    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["MEGATRON_RL_JOB_SECRET"] = secrets.token_hex(32)
    path = os.path.join(ROOT, "tests", "distributed", "workers", script)
    if not (real or nnodes_args or os.environ.get("MEGATRON_RL_TESTS_TORCHRUN") == "1"):
        return zygote().run(path, nproc, args, env, timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [path, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


class _Zygote:
    """The client of tests/zygote.py: one per test session, started at its first launch."""

    def __init__(self) -> None:
        import socket

        pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        ours, theirs = socket.socketpair()
        self.log = open(os.path.join(_scratch(), "zygote.log"), "w")  # noqa: SIM115 - the session's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        theirs.close()
        self.sock, self.buf = ours, b""
        self._read(timeout=300)  # {"ready"}: the imports are done

    def _read(self, timeout: float) -> dict:
        import time

        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"the test zygote died (exit {self.proc.poll()}); see {self.log.name}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def launch(
        self,
        target: str,
        nproc: int,
        args: list[str],
        env: dict,
        timeout: float,
        cwd: str,
        module: bool = False,
    ) -> tuple[list[int], str, str]:
        """Run ``target`` (a script path, or a module with ``module``) as ``nproc`` ranks; returns the exit
        statuses (-9 for ranks killed at ``timeout``) and the ranks' stdout and stderr, rank by rank."""
        import signal
        import socket
        import tempfile

        with socket.socket() as s:  # a free port for the ranks' rendezvous (env://, rank 0 hosts it)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tempfile.mkdtemp(prefix="ranks-", dir=_scratch())
        env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        req = dict(argv=list(args), nproc=nproc, env=env, cwd=cwd, out=out)
        req["module" if module else "script"] = target
        self.sock.sendall((json.dumps(req) + "\n").encode())
        pids = self._read(timeout=60)["pids"]
        try:
            codes = self._read(timeout=timeout)["codes"]
        except TimeoutError:
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            codes = self._read(timeout=60)["codes"]

        def read(what: str) -> str:
            text = []
            for r in range(nproc):
                with open(os.path.join(out, f"rank{r}.{what}"), errors="replace") as f:
                    text.append(f.read())
            return "".join(text)

        return codes, read("out"), read("err")

    def run(self, script: str, nproc: int, args: list[str], env: dict, timeout: float) -> str:
        codes, stdout, stderr = self.launch(script, nproc, args, env, timeout, os.getcwd())
        if any(c != 0 for c in codes):
            name = os.path.basename(script)
            pytest.fail(f"ranks of {name} failed (exit {codes}):\n{stdout[-4000:]}\n{stderr[-8000:]}")
        return stdout


_ZYGOTE: _Zygote | None = None


def zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def _scratch() -> str:
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"megatron-rl-tests-{os.getpid()}")
    os.makedirs(d, exist_ok=True)
    return d


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
