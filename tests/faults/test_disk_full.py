"""A disk that fills up during a save of real model weights (megatron-core's torch_dist writer, whose
failures torch DCP gathers into a CheckpointException, a BaseException): one line naming ENOSPC and the
path, no traceback, the partial save removed, the earlier checkpoint and the tracker untouched.

The disk is a real 8 MiB tmpfs that the test mounts in a private mount namespace (``unshare -rm``; as
root ``unshare -m``); where neither is permitted the test is skipped. This file is also the worker:
``python -m tests.faults.test_disk_full ROOT HF_DIR``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _unshare() -> list[str] | None:
    """The namespace command that may mount a tmpfs here, or None."""
    if shutil.which("unshare") is None:
        return None
    for cmd in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = ["sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d && rmdir $d"]
        if subprocess.run(cmd + probe, capture_output=True).returncode == 0:
            return cmd
    return None


def test_disk_full_during_a_model_save_is_one_line_and_loses_nothing(tmp_path):
    unshare = _unshare()
    if unshare is None:
        pytest.skip("mounting a tmpfs needs root or user namespaces (unshare -rm), neither available here")
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.run.checkpoint import LATEST, ORDER_FILE
    from megatron_rl.run.explain import PREFIX

    hf = save_random_hf_model(str(tmp_path / "hf"), "llama", num_hidden_layers=1)
    disk, report = tmp_path / "disk", tmp_path / "report"
    disk.mkdir()
    report.mkdir()
    worker = [sys.executable, "-m", "tests.faults.test_disk_full", str(disk / "run"), hf]
    # the listing is taken inside the namespace: the tmpfs is gone once it ends
    after = f"ls -A {disk}/run > {report}/ls; cat {disk}/run/{LATEST} > {report}/tracker"
    script = f'mount -t tmpfs -o size=8m tmpfs {disk} && {{ "$@"; rc=$?; {after}; exit "$rc"; }}'
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [*unshare, "sh", "-c", script, "sh", *worker], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-6000:]
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(PREFIX)]
    assert len(lines) == 1, p.stderr[-6000:]
    assert lines[0].startswith(PREFIX + "no space left on device (ENOSPC) while saving "), lines[0]
    assert f"{disk}/run/global_step_2" in lines[0] and "trainer.default_local_dir" in lines[0]
    left = sorted((report / "ls").read_text().split())
    assert left == sorted([ORDER_FILE, "filler", "global_step_1", LATEST, "run.lock"]), left
    assert (report / "tracker").read_text().strip() == "1"


def _worker(root: str, hf_dir: str) -> None:
    """Rank 0 of a one-process gloo world: save step 1 (a 1-layer Llama, megatron GPTModel), fill the
    disk to half a checkpoint's room, save step 2."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.run.checkpoint import CheckpointManager
    from megatron_rl.run.explain import explain_failures
    from megatron_rl.run.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    logging.basicConfig(level=logging.INFO)  # as the trainer's rank 0 logs
    with explain_failures():
        ps = init_parallel(1, 1, device="cpu")
        try:
            model = build_model(load_model_args(hf_dir), ps, "actor")
            load_hf_weights(model, hf_dir, ps)
            m = CheckpointManager(root, ps, claim=True)
            first = m.save(1, {"actor": model}, {}, {}, {})
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first) for f in fs)
            with open(os.path.join(root, "filler"), "wb") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(root).free - size // 2))
            m.save(2, {"actor": model}, {}, {}, {})
        finally:  # gloo's threads still running at interpreter exit abort the process (SIGABRT)
            destroy_parallel()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
