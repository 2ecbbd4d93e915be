"""Rank processes for the distributed tests without paying the imports on every launch.

A launch under torchrun starts torchrun's agent and N fresh interpreters, each importing torch,
megatron-core, transformers and megatron_rl: 5-7 s of CPU per process, most of a small test's time on
2 cores. The zygote is one process that imports all of that once (and runs nothing), then forks the N
ranks of each launch from itself: each child sets the environment torchrun would give it (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its own session, its working
directory, its stdout/stderr files, and runs the worker script as ``__main__``. As under torchrun, the
first rank that fails takes the others down (SIGKILL), and ranks die with the zygote, which dies with
the test session (PR_SET_PDEATHSIG).

What torchrun itself does (its agent, its signals, TORCHELASTIC_* variables, restarts) is tested with
real torchrun launches (``run_torchrun(..., real=True)`` and tests/faults), not here. The preloaded
modules are those on disk when the session's first launch started the zygote: a module edited during
a test session is seen as it was (MEGATRON_RL_TESTS_TORCHRUN=1 launches every rank fresh instead).

Protocol (one JSON object per line on the socket given as fd): the client sends
``{"script" (or "module"), "argv", "nproc", "env", "cwd", "out"}``; the zygote answers
``{"pids": [...]}`` once the ranks are forked and ``{"codes": [...]}`` once every rank has exited (the
exit status, or -signal).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _preload() -> None:
    """What every worker imports first (no tensor operation runs: the children start clean)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # megatron's import-time notices: each rank's own import would say them
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import transformers  # noqa: F401

        import megatron_rl.models.builder  # noqa: F401
        import megatron_rl.parallel  # noqa: F401
        import megatron_rl.trainer  # noqa: F401


def _rank(req: dict, rank: int) -> None:
    """In the forked child: become rank ``rank`` of the launch and run its script; never returns."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        out = os.open(os.path.join(req["out"], f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(os.path.join(req["out"], f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        n = str(req["nproc"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
        os.environ.update(GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=n)
        os.chdir(req["cwd"])
        try:
            if req.get("module"):  # python -m MODULE
                sys.argv = [req["module"], *req["argv"]]
                sys.path[0] = req["cwd"]
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [req["script"], *req["argv"]]
                sys.path[0] = os.path.dirname(req["script"])
                runpy.run_path(req["script"], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _launch(req: dict, conn) -> None:
    pids = []
    for r in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(req, r)
        pids.append(pid)
    _send(conn, {"pids": pids})
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        pid, status = os.wait()
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun: one rank failed, the launch is over
            for other in pids:
                if other not in codes:
                    try:
                        os.killpg(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    _send(conn, {"codes": [codes[p] for p in pids]})


def _send(conn, msg: dict) -> None:
    conn.sendall((json.dumps(msg) + "\n").encode())


def main() -> None:
    _die_with_parent()
    conn = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    _send(conn, {"ready": time.time()})
    buf = b""
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            _launch(json.loads(line), conn)


if __name__ == "__main__":
    main()
