"""``--out`` of the writing verbs: never mixed with old contents, never left half-written.

A verb writes into a staging directory beside ``--out`` (``.<name>.ckpt_tools-<pid>``) and the result
is moved into place when the verb succeeded: an existing ``--out`` that is not empty is refused
unless ``--overwrite``, and with it the old directory is replaced as a whole (renamed aside, the new
one renamed in, the old one deleted), so no stale shard of an earlier conversion stays beside the new
ones. A verb that fails leaves ``--out`` as it was and removes its staging directory. The last file
written into a finished output is its ``checksums.json`` (size and SHA-256 of every file, see
:mod:`megatron_rl.weights.digests`), which every verb checks when it reads the output back.

The staging happens in the process the user started. A job the user started under torchrun writes
``--out`` directly (every rank would have to agree on the swap); there an existing non-empty ``--out``
is refused even with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable

from ckpt_tools.launch import RESULT_ENV, under_torchrun

OUT_ENV = "CKPT_TOOLS_OUT"
"""The ``--out`` the user gave, for messages printed by re-launched ranks that write the staging copy."""


def shown_out(a: argparse.Namespace) -> str:
    """The output path to print: the user's ``--out``, not the staging directory."""
    return os.environ.get(OUT_ENV) or a.out


def _occupied(path: str) -> bool:
    if os.path.islink(path) or os.path.isfile(path):
        return True
    return os.path.isdir(path) and bool(os.listdir(path))


def run_with_staging(a: argparse.Namespace, verb: Callable[[argparse.Namespace], int]) -> int:
    """Run ``verb`` so that its output lands in ``a.out`` only on success (see the module doc)."""
    out = a.out
    if os.environ.get(RESULT_ENV) and os.environ.get(OUT_ENV):
        return verb(a)  # a rank re-launched by the process below: it writes the staging directory
    busy = _occupied(out)
    if busy and not a.overwrite:
        raise SystemExit(
            f"ckpt_tools: --out {out} is not empty: choose a new directory, or pass --overwrite to "
            "replace its contents."
        )
    if under_torchrun():
        if busy:
            raise SystemExit(
                f"ckpt_tools: --out {out} is not empty and --overwrite needs the verb started with plain "
                "python (it starts its own processes and replaces --out when they finish): run it that "
                "way, or remove --out first."
            )
        rc = verb(a)
        if rc == 0:
            import torch.distributed as dist

            if os.environ.get("RANK", "0") == "0" and os.path.isdir(out):
                _write_digests(out)  # the verb's ranks have finished writing: its last barrier is behind
            if dist.is_initialized():  # a job that goes on (its next verb may read --out) waits for it
                dist.barrier()
        return rc
    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".{name}.ckpt_tools-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    a.out = stage
    a.argv = [*a.argv, "--out", stage]  # the last --out wins when a verb re-launches itself
    os.environ[OUT_ENV] = out
    try:
        rc = verb(a)
        if rc == 0 and os.path.exists(stage):
            _write_digests(stage)
            _replace(stage, out)
        return rc
    finally:
        os.environ.pop(OUT_ENV, None)
        a.out = out
        shutil.rmtree(stage, ignore_errors=True)


def _write_digests(out: str) -> None:
    """The manifest of a finished output, written last (atomically) by one process."""
    from megatron_rl.weights.digests import digest_files, list_files, write_manifest

    write_manifest(out, digest_files(out, list_files(out)))


def _replace(stage: str, out: str) -> None:
    """Move ``stage`` to ``out``; what was at ``out`` is renamed aside first and deleted last."""
    old = None
    if os.path.lexists(out):
        if os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out):
            os.rmdir(out)
        else:
            old = f"{stage}.old"
            os.rename(out, old)
    os.rename(stage, out)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
