"""The checkpoint directory's housekeeping: file permissions, atomic small files, full-disk
detection, the one-run-per-directory lock, the leftovers of interrupted saves and prunes, and the
digests of a checkpoint's files (written at save, checked at resume, the hashing spread over the ranks).

Used by :class:`megatron_rl.run.checkpoint.CheckpointManager` (the directory layout is described there).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError
from megatron_rl.errors import CheckpointError
from megatron_rl.weights.digests import (
    DIGESTS_FILE,
    check_files,
    digest_files,
    list_files,
    read_manifest,
    write_manifest,
)

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
PERMISSIONS_KEY = "trainer.checkpoint_permissions"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER = re.compile(r"^\.global_step_\d+\.(partial|deleting)$")
"""What a save (``.global_step_N.partial``) or a prune (``.global_step_N.deleting``) leaves when it
is interrupted."""


# --------------------------------------------------------------------------------------------------
# Permissions, atomic small files, disk-full detection
# --------------------------------------------------------------------------------------------------


def parse_permissions(value: str | int | None) -> tuple[int, int]:
    """``trainer.checkpoint_permissions`` -> (file mode, directory mode). Directories get the search
    bit wherever the file mode has the read bit (0600 -> 0700, 0640 -> 0750, 0644 -> 0755)."""
    text = "0600" if value is None else str(value).strip()
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise ConfigError(
            f"{PERMISSIONS_KEY}={value!r} is not an octal file mode: give it as a quoted string (unquoted, "
            "YAML reads 0600 as the number 384) such as "
            '"0600" (owner only, the default) or "0640" (the group may read).'
        )
    mode = int(text, 8)
    if mode & 0o600 != 0o600 or mode & 0o111:
        unquoted = "" if text.startswith("0") else " (if you wrote 0NNN unquoted, YAML read it as a number)"
        raise ConfigError(
            f"{PERMISSIONS_KEY}={text}{unquoted}: a checkpoint file mode must let the owner read and write "
            '(6 in the first digit) and set no execute bits (directories get them): e.g. "0600" or "0640".'
        )
    return mode, mode | ((mode & 0o444) >> 2)


def chmod_tree(path: str, file_mode: int, dir_mode: int) -> None:
    """Set every file under ``path`` to ``file_mode`` and every directory to ``dir_mode`` (an explicit
    chmod: modes given to open/mkdir are cut by the umask)."""
    os.chmod(path, dir_mode)
    for top, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(top, d), dir_mode)
        for f in files:
            os.chmod(os.path.join(top, f), file_mode)


def write_atomic(path: str, text: str, file_mode: int) -> None:
    """Write ``text`` to ``path`` through a temporary file and one rename: a reader sees the old or the
    new content, never a torn one."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
    try:
        os.fchmod(fd, file_mode)
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    finally:
        if fd >= 0:
            os.close(fd)
    os.replace(tmp, path)


def open_private(path: str, file_mode: int, binary: bool = True):
    """A new file for writing, created with ``file_mode`` (set explicitly, past the umask). Writing
    through a Python file object makes a full disk raise OSError(ENOSPC) instead of torch's
    message-less zip-writer error."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode)
    os.fchmod(fd, file_mode)
    return os.fdopen(fd, "wb" if binary else "w")


def is_disk_full(exc: BaseException | None, path: str) -> bool:
    """True for ENOSPC anywhere in the exception's chain (or in torch DCP's per-rank failures), or
    when the filesystem of ``path`` is left with under 1 MiB (writers that drop the errno)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "ENOSPC" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    with contextlib.suppress(OSError):
        return shutil.disk_usage(path).free < 1 << 20
    return False


# --------------------------------------------------------------------------------------------------
# The run lock and the leftovers of earlier runs
# --------------------------------------------------------------------------------------------------

# Locks this process holds, by real path -> [fd, users]: flock locks belong to an open file, so a
# second open in the same process would conflict with the first; a second manager shares the first's.
_HELD: dict[str, list[int]] = {}


class DirLock:
    """An exclusive ``flock`` on ``root/run.lock``, held until :meth:`release` or the process exits.

    The kernel drops the lock when the holder dies (also by SIGKILL or a crashed node on a local
    filesystem), so a dead run never leaves a stale lock; the file itself stays and is reused. The
    file says who holds it: ``host=... pid=... started=...``.
    """

    def __init__(self, root: str, file_mode: int = 0o600) -> None:
        self.path = os.path.join(root, LOCK_FILE)
        self.file_mode = file_mode
        self._key: str | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`CheckpointError` naming the holder."""
        key = os.path.realpath(self.path)
        if key in _HELD:
            _HELD[key][1] += 1
            self._key = key
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, self.file_mode)  # not inherited across exec
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # e.g. a Lustre mount without -o flock: run unlocked rather than not at all
                os.close(fd)
                log.warning(
                    "cannot lock %s (%s): running without the one-run-per-directory lock", self.path, e
                )
                return
            holder = (
                os.pread(fd, 512, 0).decode(errors="replace").strip()
                or "a process that has not written its name yet"
            )
            os.close(fd)
            raise CheckpointError(
                f"{os.path.dirname(self.path)} is in use by another run ({holder}; lock file {self.path}): "
                "wait for that run to end or stop it, or give this run another trainer.default_local_dir."
            ) from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.fchmod(fd, self.file_mode)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} started={started}\n".encode(), 0)
        _HELD[key] = [fd, 1]
        self._key = key

    def release(self) -> None:
        if self._key is None or self._key not in _HELD:
            return
        held = _HELD[self._key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self._key]
            os.close(held[0])  # closing the last descriptor drops the flock
        self._key = None


def remove_leftovers(root: str) -> None:
    """Remove the partial saves and interrupted prunes an earlier run left in ``root`` (call it
    under the lock, so that they are never another live run's)."""
    for name in sorted(os.listdir(root)):
        if _LEFTOVER.match(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log.warning(
                "removed %s: a save or prune that an earlier run did not finish (no rank of this run "
                "wrote it; the directory is locked by this run)",
                os.path.join(root, name),
            )


# --------------------------------------------------------------------------------------------------
# Digests of the checkpoint's files (megatron_rl.weights.digests), the hashing spread over the ranks
# --------------------------------------------------------------------------------------------------

_DCP_FILE = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")
_VERIFIED: dict[str, tuple] = {}
"""Rank 0's record of the checkpoints verified in this process: path -> the (size, mtime, inode) of the
manifest and of every file it lists, so that a second load of unchanged files does not hash them again."""


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any (gloo on CPU, or the default group's device)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's part of ``names``: a torch_dist data file ``__R_N.distcp`` goes to rank R (its writer,
    whose node still caches it), every other file by its position."""
    out = []
    for i, name in enumerate(names):
        m = _DCP_FILE.search(name)
        if (int(m.group(1)) if m else i) % world == rank:
            out.append(name)
    return out


def _on_rank0(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()`` computed on rank 0 and handed to every rank: (value, None), or (None, the one-line
    message of the CheckpointError it raised)."""
    rank, world = _world()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = (fn(), None)
        except (CheckpointError, OSError) as e:
            box[0] = (None, str(e))
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any]:
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def write_digests(partial: str, file_mode: int) -> None:
    """Collective, once every rank has written into ``partial`` (before it is published): rank 0 lists
    the files, each rank hashes its share, rank 0 writes the manifest of them all, atomically. A file
    that cannot be read back fails the save on every rank."""
    rank, world = _world()
    names, _ = _on_rank0(lambda: list_files(partial))
    try:
        mine, failed = digest_files(partial, _share(names, rank, world)), None
    except OSError as e:
        mine, failed = {}, f"cannot read {e.filename} back to digest it ({e.strerror or e})"
    parts = _gather((mine, failed))
    if failures := [f for _, f in parts if f]:
        raise CheckpointError(f"saving {partial} failed: {failures[0]}.")
    if rank == 0:
        write_manifest(partial, {k: v for m, _ in parts for k, v in m.items()}, file_mode)


def _stats(path: str, names: list[str]) -> tuple:
    out = []
    for name in [DIGESTS_FILE, *names]:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(path, name))
            out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _resume_fix(path: str) -> str:
    """What to do about a damaged checkpoint ``path``: restore the file, or resume from the newest other
    complete checkpoint beside it (or start over when there is none)."""
    root, name = os.path.split(os.path.abspath(path))
    steps = [(int(m.group(1)), d) for d in os.listdir(root) if (m := STEP_DIR.match(d)) and d != name]
    steps = [s for s in sorted(steps) if os.path.isfile(os.path.join(root, s[1], "trainer_state.json"))]
    if not steps:
        return "restore it from a copy, or start over with trainer.resume_mode=disable"
    return (
        "restore it from a copy, or resume from another checkpoint: trainer.resume_mode=resume_path "
        f"trainer.resume_from_path={os.path.join(root, steps[-1][1])}"
    )


def verify_digests(path: str) -> None:
    """Collective over the training ranks, before anything of checkpoint ``path`` is read: rank 0 reads
    its manifest, each rank hashes its share of the files, and a file that is missing, truncated or
    damaged on any rank stops every rank with the same one line naming it (:class:`CheckpointError`).
    A checkpoint saved before manifests were written loads unchecked, with one log line."""
    rank, world = _world()
    path = os.path.abspath(path)

    def plan() -> tuple[Any, ...]:
        entries = read_manifest(path)
        stats = _stats(path, sorted(entries or ()))
        return entries, stats, _VERIFIED.get(path) == stats, _resume_fix(path)

    found, error = _on_rank0(plan)
    if error is not None:
        raise CheckpointError(error)
    entries, stats, unchanged, fix = found
    if unchanged:
        return
    if entries is None:
        if rank == 0:
            _VERIFIED[path] = stats
            log.info(
                "%s has no %s (saved before checkpoints carried digests): loading it without a digest check",
                path,
                DIGESTS_FILE,
            )
        return
    problem = check_files(path, {n: entries[n] for n in _share(sorted(entries), rank, world)})
    if problems := sorted(p for p in _gather(problem) if p):
        raise CheckpointError(f"{problems[0]}: {fix}.")
    if rank == 0:
        _VERIFIED[path] = stats
