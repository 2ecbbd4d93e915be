"""Pre-flight checks of a launch, on every rank before any process group starts.

The trainer (``megatron_rl.train.main``)::

    with explain_failures():
        cfg = load_config(path, overrides)
        preflight(cfg, world_size)        # launch layout, device and model paths, then config.validate
        ...                               # init_parallel, Trainer(cfg, ps).fit()

Each check raises a one-line :class:`~megatron_rl.errors.LaunchError` or ``ConfigError``, which
:func:`megatron_rl.explain.explain_failures` prints without a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from megatron_rl.config import ConfigError, validate
from megatron_rl.config.placement import resolve_placement
from megatron_rl.errors import LaunchError
from megatron_rl.explain import explain_text, no_gpu_for_local_rank


def preflight(cfg: Any, world_size: int, env: Mapping[str, str] | None = None) -> None:
    """Check that this launch can run ``cfg`` before any process group starts, then ``config.validate``.

    Raises :class:`LaunchError` (launch layout, device) or ``ConfigError`` (from validate), each a
    one-line message. ``env`` defaults to ``os.environ`` (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE).
    """
    env = os.environ if env is None else env
    mp = cfg.actor_rollout_ref.actor.megatron
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    per_node = int(env.get("LOCAL_WORLD_SIZE", world_size))
    nodes = max(1, world_size // max(per_node, 1))
    train = len(resolve_placement(cfg, world_size).actor)  # the actor's ranks (trainer.placement)
    if tp >= 1 and pp >= 1 and train % (tp * pp):
        where = "" if train == world_size else f" (the {train} actor ranks of trainer.placement.actor)"
        raise LaunchError(
            f"world size {world_size}{where} ({nodes} node(s) x {per_node} process(es) per node) does not "
            f"fit the parallel layout TP={tp} x PP={pp}: launch a multiple of {tp * pp} processes "
            "(launch/torchrun.sh --nproc, torchrun --nproc_per_node, sbatch --nodes) or set "
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size x pipeline_model_parallel_size "
            f"to a divisor of {train}.",
            same_on_all_ranks=True,
        )
    for key, want, got in (
        ("trainer.nnodes", cfg.trainer.nnodes, nodes),
        ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node, per_node),
    ):
        if want is not None and want != got:
            raise LaunchError(
                f"{key}={want} but this job was launched with {got} ({nodes} node(s) x {per_node} "
                f"process(es) per node): launch it to match, or leave {key} unset (the launch decides).",
                same_on_all_ranks=True,
            )
    _check_device(cfg.trainer.device, env)
    _check_model_paths(cfg)
    validate(cfg, world_size=world_size)


def _check_model_paths(cfg: Any) -> None:
    """Model and tokenizer paths are local directories (nothing is downloaded): one line if not."""
    for key, path in (
        ("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path),
        ("critic.model.path", cfg.critic.model.path if cfg.critic.enable else None),
        ("data.tokenizer", cfg.data.tokenizer),
    ):
        if path and not os.path.isdir(path):
            raise ConfigError(
                f"{key}={path}: no such directory. Point it at a local HF model directory or Megatron "
                "checkpoint (models are not downloaded from a hub)."
            )
        if path and key != "data.tokenizer":
            from megatron_rl.models.loading import detect_format

            try:
                detect_format(path)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{key}={path}: {e}") from None


def _check_device(device: str, env: Mapping[str, str]) -> None:
    import torch

    from megatron_rl.parallel import resolve_device

    rank = env.get("RANK", "0")
    try:
        dev = resolve_device(device)
    except RuntimeError as e:
        raise LaunchError(explain_text(str(e), rank=rank) or f"rank {rank}: {e}") from None
    if dev.type == "cuda":
        local_rank, count = int(env.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local_rank >= count:
            raise LaunchError(no_gpu_for_local_rank(rank, local_rank, count))
