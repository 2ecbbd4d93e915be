"""Running a verb as N gloo processes: reuse torchrun's processes, or re-launch under torchrun.

A verb that needs TP x PP ranks calls :func:`relaunch_if_needed` first. Without torchrun's
environment it runs ``python -m torch.distributed.run --standalone --nproc_per_node=N -m ckpt_tools
<same arguments>`` and returns the job's result; the children (and a job already started by
torchrun) get None and do the work. torchrun gives each process its rank and a free rendezvous port,
and exits non-zero if any rank crashes. A verb's own verdict (``verify`` failing its tolerance) is
not a crash: re-launched children report it through the file named by ``RESULT_ENV`` and exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RESULT_ENV = "CKPT_TOOLS_RESULT_FILE"


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def relaunch_if_needed(nproc: int, argv: list[str]) -> int | None:
    """Exit code of the re-launched job, or None if this process should do the work itself."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world % nproc:
            raise SystemExit(
                f"this verb needs a multiple of {nproc} processes (TP x PP), torchrun started {world}"
            )
        return None
    if nproc == 1:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="ckpt_tools_") as tmp:
        result = os.path.join(tmp, "rc")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        env[RESULT_ENV] = result
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "ckpt_tools", *argv]
        print(
            f"[ckpt_tools] running {nproc} gloo processes: {' '.join(cmd[1:])}", file=sys.stderr, flush=True
        )
        rc = subprocess.run(cmd, env=env).returncode
        if rc == 0 and os.path.isfile(result):
            with open(result) as f:
                rc = int(f.read().strip() or 0)
        return rc


def report(code: int) -> int:
    """The process exit code for a verb's result; in a re-launched job rank 0 files it instead."""
    path = os.environ.get(RESULT_ENV)
    if path is None:
        return code
    if os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            f.write(str(code))
    return 0


def require_single_process(verb: str) -> None:
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit(f"{verb} runs in one process; start it with python, not torchrun")
