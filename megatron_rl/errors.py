"""Errors whose message is one actionable line for the launcher, and the words the explanations share.

The bottom of the failure-reporting stack: any layer raises these without importing the layers that
explain them (:mod:`megatron_rl.run.explain` on a rank, :mod:`megatron_rl.run.launch_checks` in the
launcher). ``ConfigError`` and ``DataError`` live in :mod:`megatron_rl.config`, the bottom layer of
the configuration.
"""

from __future__ import annotations

COLLATERAL = "this rank is collateral"
"""Marks an explained failure as a consequence of another rank's: a node's log explanation
(``launch_checks.explain_log``) reports such a line only when it finds nothing else."""


class LaunchError(RuntimeError):
    """A launch that cannot work (layout vs world size, device, port); the message is one actionable line.

    ``same_on_all_ranks``: every rank raises the same error, so only local rank 0 of each node prints it.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = False) -> None:
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


class CheckpointError(LaunchError):
    """A problem with the checkpoint directory (tracker, lock, disk); the message is one line naming the
    file and the fix, printed by the launcher's ``explain_failures`` without a traceback."""

    def __init__(self, message: str, same_on_all_ranks: bool = True) -> None:
        super().__init__(message, same_on_all_ranks)


class NonFiniteRewardError(LaunchError):
    """A reward that is NaN or infinite, stopped where it entered (a reward function, a tool, an agent
    harness, a reward server or model): one line naming the source, the row and the key to look at. One
    such reward would void a whole step's update, so it is never trained on."""


class ModelRefused(LaunchError, ValueError):
    """A model or checkpoint this project does not load (an architecture or a layout it does not build):
    one line naming the path, what it holds and what to do, printed without a traceback by the trainer
    and by ``ckpt_tools``. A ValueError too, for callers that treat any bad model value alike."""

    def __init__(self, message: str) -> None:
        super().__init__(message, same_on_all_ranks=True)
