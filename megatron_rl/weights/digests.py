"""Digests of checkpoint files: a manifest written when a checkpoint is saved, checked before it is read.

A save lists every file it wrote, with its size and SHA-256, in ``checksums.json`` at the top of the
checkpoint directory; the manifest is written last, atomically, before the directory is published. A
reader finds the manifest in the directory it opens or in one of its two parents (``global_step_N/actor``
is covered by ``global_step_N/checksums.json``) and refuses, in one line naming the file, a listed file
that is missing, has another size or another digest. A digest detects accidental damage (a flipped bit,
a truncated copy, a file overwritten by another); it does not detect someone who rewrites the manifest
too. A checkpoint without a manifest (saved before digests were written, or by another tool) is read
unchecked; the callers say so.

The trainer's save and resume spread the hashing over their ranks (:mod:`megatron_rl.run.ckpt_files`);
``ckpt_tools`` writes the manifest of its outputs and checks its inputs in one process.
"""

from __future__ import annotations

import hashlib
import json
import os

from megatron_rl.errors import CheckpointError

DIGESTS_FILE = "checksums.json"
ALGORITHM = "sha256"
_FORMAT = "megatron-rl checksums"
DEFAULT_FIX = "restore the file from a copy of the checkpoint, or use an earlier checkpoint"

Entries = dict[str, dict]
"""Relative path (``/``-separated) -> {"size": bytes, "sha256": hex digest}."""


def digest_file(path: str) -> dict:
    """{"size", "sha256"} of one file, read once in large blocks."""
    with open(path, "rb") as f:
        h = hashlib.file_digest(f, ALGORITHM)
        return {"size": f.tell(), ALGORITHM: h.hexdigest()}


def list_files(root: str) -> list[str]:
    """Every file under ``root`` (relative, sorted), except the manifest itself."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(top, root)
        for f in files:
            if top == root and f.startswith(DIGESTS_FILE):
                continue
            out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(out)


def digest_files(root: str, rels: list[str]) -> Entries:
    return {rel: digest_file(os.path.join(root, rel)) for rel in rels}


def write_manifest(root: str, entries: Entries, file_mode: int | None = None) -> str:
    """Write ``root/checksums.json`` through a temporary file, fsync and one rename; ``file_mode``:
    the file's mode (None: the umask decides)."""
    path = os.path.join(root, DIGESTS_FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if file_mode is None else file_mode)
    if file_mode is not None:
        os.fchmod(fd, file_mode)
    with os.fdopen(fd, "w") as f:
        body = {
            "format": _FORMAT,
            "version": 1,
            "algorithm": ALGORITHM,
            "files": dict(sorted(entries.items())),
        }
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(root: str) -> Entries | None:
    """The entries of ``root/checksums.json``; None when there is none. An unreadable manifest raises
    :class:`CheckpointError` naming it."""
    path = os.path.join(root, DIGESTS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        files = body["files"]
        ok = body["algorithm"] == ALGORITHM and all(
            isinstance(e["size"], int) and isinstance(e[ALGORITHM], str) for e in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        ok, files = False, f"{type(e).__name__}: {e}"
    if not ok:
        raise CheckpointError(
            f"the checksum manifest {path} is damaged (not the {ALGORITHM} list megatron-rl writes at save): "
            "restore it from a copy of the checkpoint, or delete it to read the checkpoint without a digest "
            "check."
        )
    return files


def find_manifest(path: str) -> tuple[str, Entries] | None:
    """(the manifest's directory, its entries for the files under ``path``) from ``path`` or one of its
    two parents, the nearest that lists a file under ``path``; None when none does."""
    here = os.path.abspath(path)
    top = here
    for _ in range(3):
        entries = read_manifest(top)
        if entries is not None:
            prefix = os.path.relpath(here, top).replace(os.sep, "/")
            if prefix == ".":
                return top, entries
            under = {r: e for r, e in entries.items() if r.startswith(prefix + "/")}
            if under:
                return top, under
        if os.path.dirname(top) == top:
            break
        top = os.path.dirname(top)
    return None


def check_files(root: str, entries: Entries) -> str | None:
    """What is wrong with the first file of ``entries`` (under ``root``) that does not match, or None."""
    manifest = os.path.join(root, DIGESTS_FILE)
    for rel, want in sorted(entries.items()):
        path = os.path.join(root, rel)
        try:
            size = os.path.getsize(path)
            if size != want["size"]:
                what = "is empty" if size == 0 else "is truncated" if size < want["size"] else "has grown"
                return f"checkpoint file {path} {what} ({size} bytes, {want['size']} at save per {manifest})"
            if digest_file(path)[ALGORITHM] != want[ALGORITHM]:
                return (
                    f"checkpoint file {path} is damaged (its {ALGORITHM} differs from the one {manifest} "
                    "recorded at save)"
                )
        except FileNotFoundError:
            return f"checkpoint file {path} is missing (listed in {manifest}, written at save)"
        except OSError as e:
            return f"cannot read checkpoint file {path} ({e.strerror or e})"
    return None


def verify_checkpoint(path: str, fix: str = DEFAULT_FIX) -> str | None:
    """Check every file of the checkpoint at ``path`` against its manifest, in this process; a bad file
    raises a one-line :class:`CheckpointError` ending in ``fix``. Returns the manifest's path, or None
    when ``path`` has none (the caller says so)."""
    found = find_manifest(path)
    if found is None:
        return None
    root, entries = found
    problem = check_files(root, entries)
    if problem is not None:
        raise CheckpointError(f"{problem}: {fix}.")
    return os.path.join(root, DIGESTS_FILE)
