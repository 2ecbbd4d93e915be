"""The checkpoint directory's guards: pruning by save order, the tracker, the one-run lock, leftovers
of interrupted saves, file permissions and a full disk.

Saves run ``CheckpointManager.save`` for real in a separate one-process gloo world (this file is also
the worker: ``python -m tests.unit.test_ckpt_guard ROOT --steps ...``); the disk-full case writes to a
real 256 KiB tmpfs mounted in a private user+mount namespace (``unshare -rm``), or, where namespaces
are not available, fails the file writes with OSError(ENOSPC) at the file boundary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_rl.errors import CheckpointError
from megatron_rl.run import explain as ex
from megatron_rl.run.checkpoint import LATEST, ORDER_FILE, CheckpointManager
from tests.conftest import ROOT


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    return {**env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def job(root, *runs: tuple[int, ...], keep: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The worker's arguments for one directory: each of ``runs`` is one run's saves (a new manager, as
    a new job would have); ``keep`` and ``extra`` options apply to the last run."""
    args = [str(root)]
    for steps in runs:
        args += ["--run", ",".join(map(str, steps))]
    if keep:
        args += ["--keep", str(keep)]
    return [*args, *extra]


def save_steps(*jobs: list[str]) -> subprocess.CompletedProcess:
    """Run the worker once for all of ``jobs`` (one process start: the imports cost seconds each)."""
    cmd = [sys.executable, "-m", "tests.unit.test_ckpt_guard"]
    cmd += [arg for i, args in enumerate(jobs) for arg in ([] if i == 0 else ["--then"]) + args]
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, object]]:
    """The worker's saves of the tests below, in one process: (the process, {job: its root})."""
    base = tmp_path_factory.mktemp("saves")
    roots = {name: base / name / "run" for name in ("order_file", "no_order_file", "resumed", "private")}
    jobs = [
        # an older run left global_step_8 and global_step_10; a new one saves 2, 4, 6, keeping 2
        job(roots["order_file"], (8, 10), (2, 4, 6), keep=2),
        job(roots["no_order_file"], (8, 10), (2, 4, 6), keep=2, extra=("--drop-order-file",)),
        job(
            roots["resumed"],
            (2,),
            (4, 6, 8),
            keep=1,
            extra=("--resumed", str(roots["resumed"] / "global_step_2")),
        ),
        job(roots["private"], (1,)),
    ]
    umask = os.umask(0o022)  # the usual umask, which alone would leave 0644 files and 0755 directories
    try:
        return save_steps(*jobs), roots
    finally:
        os.umask(umask)


def _dirs(root) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith(("global_step_", ".global_step_")))


def _manager(root, keep=None) -> CheckpointManager:
    """A manager as rank 0 of a one-process job, without a process group (the rank-0 parts only)."""
    ps = SimpleNamespace(rank=0, tp_size=1, pp_size=1, dp_size=1, world_size=1)
    return CheckpointManager(str(root), ps, keep)


# ------------------------------------------------------------------------------------------ pruning


@pytest.mark.parametrize("older_run_has_order_file", [True, False])
def test_pruning_keeps_the_newest_by_save_order(saved, older_run_has_order_file):
    """An older run left global_step_8 and global_step_10; a new run (no resume) saves 2, 4, 6 with
    max_ckpt_to_keep=2: 4 and 6 remain (not 8 and 10, the highest numbers), the tracker says 6."""
    p, roots = saved
    root = roots["order_file" if older_run_has_order_file else "no_order_file"]  # an older version wrote none
    assert p.returncode == 0, p.stderr
    assert _dirs(root) == ["global_step_4", "global_step_6"]
    assert (root / LATEST).read_text().strip() == "6"
    assert (root / ORDER_FILE).read_text().split() == ["global_step_4", "global_step_6"]
    assert _manager(root).resume_path() == str(root / "global_step_6")


def test_pruning_spares_the_checkpoint_the_run_resumed_from(saved):
    p, roots = saved
    root = roots["resumed"]
    assert p.returncode == 0, p.stderr
    assert _dirs(root) == ["global_step_2", "global_step_8"]


def test_files_and_directories_are_private_by_default(saved, tmp_path):
    """0600 files, 0700 directories: weights, trainer_state.json, the tracker, the order file, the lock;
    trainer.checkpoint_permissions="0640" gives 0640 / 0750."""
    p, roots = saved  # saved under umask 0022
    root, shared = roots["private"], tmp_path / "shared"
    umask = os.umask(0o022)  # the usual umask, which alone would leave 0644 files and 0755 directories
    try:
        assert p.returncode == 0, p.stderr
        # the 0640 variant: rank 0's publication step (the chmod walk, tracker, order file) in-process
        ps = SimpleNamespace(rank=0, tp_size=1, pp_size=1, dp_size=1, world_size=1)
        manager = CheckpointManager(str(shared), ps, permissions="0640", claim=True)
        (shared / ".global_step_1.partial" / "actor").mkdir(parents=True)
        (shared / ".global_step_1.partial" / "trainer_state.json").write_text("{}")
        (shared / ".global_step_1.partial" / "mp_rank_00_000.pt").write_bytes(b"")
        manager._publish(str(shared / ".global_step_1.partial"), str(shared / "global_step_1"), 1)
        manager.release()
    finally:
        os.umask(umask)
    for base, fmode, dmode in ((root, 0o600, 0o700), (shared, 0o640, 0o750)):
        ckpt = base / "global_step_1"
        files = [ckpt / "trainer_state.json", ckpt / "mp_rank_00_000.pt", base / LATEST, base / ORDER_FILE]
        for f in [*files, base / "run.lock"]:
            assert stat.S_IMODE(f.stat().st_mode) == fmode, f"{f}: {oct(f.stat().st_mode)}"
        for d in (base, ckpt):
            assert stat.S_IMODE(d.stat().st_mode) == dmode, f"{d}: {oct(d.stat().st_mode)}"
    assert stat.S_IMODE((shared / "global_step_1" / "actor").stat().st_mode) == 0o750


@pytest.mark.parametrize("value", ["0644x", "0400", "0755", "384"])
def test_bad_permissions_are_a_one_line_config_error(value):
    from megatron_rl.config import ConfigError
    from megatron_rl.run.ckpt_files import parse_permissions

    with pytest.raises(ConfigError, match="trainer.checkpoint_permissions") as e:
        parse_permissions(value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ tracker


@pytest.mark.parametrize(
    "content, expect",
    [
        ("12\n", "names {root}/global_step_12, which does not exist"),
        ("", "holds nothing, not a step number"),
        ("global_step_4 garbage", "holds 'global_step_4 garbage', not a step number"),
        ("\x00\x01", "not a step number"),
    ],
)
def test_unusable_tracker_stops_resume_in_one_line(tmp_path, content, expect):
    """resume_mode=auto never silently restarts at step 0: the error names the tracker and the fix."""
    root = tmp_path / "run"
    (root / "global_step_4").mkdir(parents=True)
    (root / "global_step_4" / "trainer_state.json").write_text("{}")
    (root / LATEST).write_text(content)
    manager = _manager(root)
    with pytest.raises(CheckpointError) as e:
        manager.resume_path()
    msg = ex.explain(e.value)  # what the launcher prints (explain_failures): the message, one line
    assert msg == str(e.value) and "\n" not in msg
    assert str(root / LATEST) in msg and expect.format(root=root) in msg, msg
    assert "trainer.resume_from_path" in msg and "trainer.resume_mode=disable" in msg
    assert manager.latest() is None  # the lenient lookup (end-of-run summary) does not raise


def test_checkpoints_without_a_tracker_are_not_ignored(tmp_path):
    root = tmp_path / "run"
    for s in (3, 10):
        (root / f"global_step_{s}").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"no {LATEST}.*resume_from_path={root}/global_step_10"):
        _manager(root).resume_path()
    assert _manager(tmp_path / "empty").resume_path() is None  # a fresh directory: a fresh run


# ------------------------------------------------------------------------------------------ lock, leftovers


def test_second_run_on_the_directory_fails_naming_the_holder(tmp_path):
    """Another process holds the lock: one line with its host, pid and start time. Killed with -9, it
    leaves the lock file behind but not the lock: the next run takes it."""
    root = tmp_path / "run"
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron_rl.run.ckpt_files import DirLock; "
         "DirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)", str(root)],
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError) as e:
            _manager(root).claim()
        msg = ex.explain(e.value)
        assert msg is not None and "\n" not in msg
        assert f"{root} is in use by another run" in msg and f"pid={holder.pid}" in msg and "started=" in msg
        assert "host=" in msg and "trainer.default_local_dir" in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (root / "run.lock").exists()
    manager = _manager(root)
    manager.claim()  # the dead run's lock file is reused
    try:
        assert f"pid={os.getpid()} " in (root / "run.lock").read_text()
    finally:
        manager.release()


def test_leftovers_of_interrupted_saves_are_removed_at_start(tmp_path, caplog):
    root = tmp_path / "run"
    for d in (".global_step_6.partial/actor", ".global_step_2.deleting", "global_step_4"):
        (root / d).mkdir(parents=True)
    (root / ".global_step_6.partial" / "actor" / "x.distcp").write_bytes(b"half")
    manager = _manager(root)
    with caplog.at_level(logging.INFO, logger="megatron_rl.run.checkpoint"):
        manager.claim()
    manager.release()
    assert _dirs(root) == ["global_step_4"]
    assert any(".global_step_6.partial" in r.getMessage() for r in caplog.records), caplog.text


# ------------------------------------------------------------------------------------------ full disk


def _tmpfs_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d"],
        capture_output=True,
    )
    return probe.returncode == 0


def test_full_disk_fails_the_save_in_one_line_and_keeps_earlier_checkpoints(tmp_path):
    """Step 1 fits, step 2 does not: one line naming ENOSPC and the path, exit 1, the partial
    directory removed, global_step_1 and the tracker as they were."""
    disk, report = tmp_path / "disk", tmp_path / "report"
    disk.mkdir()
    report.mkdir()
    worker = [sys.executable, "-m", "tests.unit.test_ckpt_guard", str(disk / "run"), "--run", "1,2"]
    worker += ["--big-from", "2"]
    # the listing is taken inside the namespace: the tmpfs is gone once it ends
    after = f'ls -A {disk}/run > {report}/ls; cat {disk}/run/{LATEST} > {report}/tracker; exit "$rc"'
    if _tmpfs_available():
        script = f'mount -t tmpfs -o size=256k tmpfs {disk} && {{ "$@"; rc=$?; {after}; }}'
        cmd = ["unshare", "-rm", "sh", "-c", script, "sh", *worker]
    else:
        cmd = ["sh", "-c", f'"$@"; rc=$?; {after}', "sh", *worker, "--fake-enospc"]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(ex.PREFIX + "no space left on device (ENOSPC) while saving "), lines[0]
    assert f"{disk}/run/global_step_2" in lines[0] and "trainer.default_local_dir" in lines[0]
    assert sorted((report / "ls").read_text().split()) == sorted(
        [LATEST, ORDER_FILE, "global_step_1", "run.lock"]
    )
    assert (report / "tracker").read_text().strip() == "1"


# ------------------------------------------------------------------------------------------ the worker


def _worker(argv: list[str]) -> None:
    """One-process gloo world: CheckpointManager.save of each --steps (no models: the shard file and
    trainer_state.json are what a save of any size writes through the same path), for each directory's
    arguments (separated by ``--then``) in turn."""
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--run", action="append", required=True, help="steps of one run, e.g. 2,4,6")
    ap.add_argument("--drop-order-file", action="store_true", help="before the last run")
    ap.add_argument("--keep", type=int)
    ap.add_argument("--resumed")
    ap.add_argument("--permissions", default="0600")
    ap.add_argument("--big-from", type=int, default=1 << 30, help="from this step on, write 8 MB per save")
    ap.add_argument("--fake-enospc", action="store_true", help="big writes fail with ENOSPC at the file")
    jobs, current = [], []
    for arg in argv:
        if arg == "--then":
            jobs.append(ap.parse_args(current))
            current = []
        else:
            current.append(arg)
    jobs.append(ap.parse_args(current))

    import torch

    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.run import checkpoint
    from megatron_rl.run.explain import explain_failures
    from megatron_rl.run.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    logging.basicConfig(level=logging.INFO)
    if any(a.fake_enospc for a in jobs):  # the boundary: the file a save writes its shard into
        real_open = checkpoint.open_private

        class _FullFile:
            def __init__(self, f):
                self.f, self.n = f, 0

            def write(self, b):
                self.n += len(b)
                if self.n > 256 << 10:
                    raise OSError(28, os.strerror(28))
                return self.f.write(b)

            def __getattr__(self, k):
                return getattr(self.f, k)

            def __enter__(self):
                return self

            def __exit__(self, *e):
                self.f.close()

        checkpoint.open_private = lambda *args, **kw: _FullFile(real_open(*args, **kw))
    with explain_failures():
        ps = init_parallel(1, 1, device="cpu")
        try:
            for a in jobs:
                for i, run in enumerate(a.run):
                    last = i == len(a.run) - 1
                    if last and a.drop_order_file:
                        os.remove(os.path.join(a.root, checkpoint.ORDER_FILE))
                    keep = a.keep if last else None
                    m = CheckpointManager(a.root, ps, keep, permissions=a.permissions, claim=True)
                    m.resumed_from = a.resumed if last else None
                    for step in map(int, run.split(",")):
                        blob = torch.zeros((2 << 20) if step >= a.big_from else 16)
                        m.save(step, {}, {}, {"blob": blob}, {"note": json.dumps({"step": step})})
                    m.release()
        finally:  # gloo's threads still running at interpreter exit abort the process (SIGABRT)
            destroy_parallel()


if __name__ == "__main__":
    _worker(sys.argv[1:])
