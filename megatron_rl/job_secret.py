"""The job's secret: the key of the HMAC that signs what roles on ranks of their own leave in the job's
key-value store (``roles.transport.Mailbox``).

launch/torchrun.sh puts a random secret in ``MEGATRON_RL_JOB_SECRET`` unless the user set one (one node:
a new one for each torchrun it starts); launch/slurm.sbatch makes one per job and srun hands it to every
node. :func:`parallel.init_parallel <megatron_rl.parallel.init_parallel>` reads it once, when a role has
ranks of its own, into the :class:`JobSecret` that ``ParallelState.job_secret`` carries to the
Mailboxes; nothing else reads the variable. Without it those ranks refuse to start (:func:`read`): a
key derived from what every rank knows would be known to whoever reads the store too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Mapping

from megatron_rl.errors import LaunchError

ENV = "MEGATRON_RL_JOB_SECRET"
"""The environment variable the launcher hands the secret in."""

MIN_CHARS = 16
"""The shortest secret accepted (the launcher's are 64 hex characters)."""

MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_hex(32))'"


class JobSecret:
    """The job's HMAC-SHA256 key; its repr never shows it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = bytes(key)

    @classmethod
    def random(cls) -> JobSecret:
        """A fresh secret (tests, and processes that are a whole job by themselves)."""
        return cls(secrets.token_bytes(32))

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``parts``, each length-prefixed, so no two splits of the same bytes agree."""
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(struct.pack("<Q", len(p)))
            h.update(p)
        return h.digest()

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"


def read(environ: Mapping[str, str] | None = None) -> JobSecret:
    """The secret in ``environ`` (default: this process's environment), or a one-line LaunchError saying
    what to set: every rank of the job reads the same variable, so every rank refuses alike."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    if not value:
        raise LaunchError(
            "trainer.placement gives a role ranks of its own, whose messages in the job's store are signed "
            f"with the job's secret, but {ENV} is not set: start the job with launch/torchrun.sh or "
            f"launch/slurm.sbatch (they set one), or export the same random value on every node before "
            f'torchrun: export {ENV}="$({MAKE_ONE})" (docs/placement.md).',
            same_on_all_ranks=True,
        )
    if len(value) < MIN_CHARS:
        raise LaunchError(
            f"{ENV} holds {len(value)} characters, fewer than {MIN_CHARS}: a secret that short can be "
            f'guessed; use e.g. export {ENV}="$({MAKE_ONE})" (docs/placement.md).',
            same_on_all_ranks=True,
        )
    return JobSecret(value.encode())
