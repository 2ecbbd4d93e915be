"""The batch-size relations of a config for a job's data-parallel sizes (config.checks.validate calls
it), every one of them reported at once.

verl's rule, in samples: a step's data.train_batch_size x rollout.n samples are split evenly over the
data-parallel ranks, so that product must be a multiple of the data-parallel size; a mini-batch's
ppo_mini_batch_size x rollout.n samples likewise (and, without dynamic batching, of data-parallel size
x ppo_micro_batch_size_per_gpu). The prompt counts themselves need not divide: with 8 ranks,
train_batch_size=4 and n=8 give each rank 4 samples, the samples of one prompt on two ranks
(:func:`samples_per_draw`)."""

from __future__ import annotations

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import ConfigErrors
from megatron_rl.config.placement import Placement
from megatron_rl.config.schema import Config

_N = "actor_rollout_ref.rollout.n"


def samples_per_draw(cfg: Config, dp_size: int) -> int:
    """The samples each prompt the sampler hands a rank stands for: rollout.n when data.train_batch_size
    divides over the ``dp_size`` ranks (each rank generates every sample of its prompts), else 1 (each
    rank takes its slice of the train_batch_size x n samples, a prompt once per sample of its slice)."""
    n = cfg.actor_rollout_ref.rollout.n
    return n if cfg.data.train_batch_size % dp_size == 0 else 1


def _fits(value: int, n: int, by: int) -> int:
    """The least v >= value with v x n a multiple of ``by`` (the nearest fix to suggest)."""
    v = max(value, 1)
    while (v * n) % by:
        v += 1
    return v


def check_batch_sizes(cfg: Config, dp: int, tp: int, pp: int, placement: Placement) -> None:
    """Every batch-size relation at once (a user fixing one should not meet the next on the next
    launch): train and mini-batches in samples against the data-parallel sizes, mini-batches against
    the train batch, micro-batches against the sequences per rank, for the actor and the critic. One
    problem: ConfigError; several: ConfigErrors, one line each."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    train, n = cfg.data.train_batch_size, rollout.n
    problems: list[str] = []

    def samples_divide(key: str, value: int, by: int, where: str = "") -> bool:
        if value <= 0 or n <= 0:
            problems.append(f"{key}={value} and {_N}={n} must be positive.")
            return False
        if (value * n) % by:
            problems.append(
                f"{key} x {_N} = {value} x {n} = {value * n} samples must be a multiple of the "
                f"data-parallel size {by}{where}, so that every rank trains the same number of samples: "
                f"e.g. {key}={_fits(value, n, by)}, or another {_N}."
            )
            return False
        return True

    samples_divide("data.train_batch_size", train, dp)
    mini_ok = samples_divide("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size, dp)
    if actor.ppo_mini_batch_size > 0 and train % actor.ppo_mini_batch_size:
        problems.append(
            f"data.train_batch_size={train} is not a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}."
        )
    seqs_per_rank = actor.ppo_mini_batch_size * n // dp
    micro = actor.ppo_micro_batch_size_per_gpu
    if mini_ok and not actor.use_dynamic_bsz and (micro <= 0 or seqs_per_rank % micro):
        fits = [d for d in range(1, seqs_per_rank + 1) if seqs_per_rank % d == 0]
        problems.append(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must be positive and divide "
            f"the {seqs_per_rank} sequences per rank of a mini-batch (ppo_mini_batch_size x rollout.n / "
            f"data-parallel size); choose one of {fits}."
        )
    if cfg.critic.enable:
        crit_mb, crit_dp, where = cfg.critic.ppo_mini_batch_size, dp, ""
        if crit_mb is None:  # load_config sets it to the actor's
            raise ConfigError(
                "critic.ppo_mini_batch_size is None: load the config with load_config, which sets it to "
                "actor_rollout_ref.actor.ppo_mini_batch_size."
            )
        if placement.separate_critic:  # the critic's own ranks: its own data-parallel size
            where = f" of the critic's ranks trainer.placement.critic={list(placement.critic)}"
            if len(placement.critic) % (tp * pp):
                raise ConfigError(
                    f"trainer.placement.critic={list(placement.critic)}: {len(placement.critic)} ranks are "
                    f"not a multiple of tensor x pipeline parallel size {tp} x {pp} (critic.megatron.*)."
                )
            crit_dp = len(placement.critic) // (tp * pp)
        # the critic's mini-batch is the actor's unless set: a relation of the same numbers is said once
        same = crit_mb == actor.ppo_mini_batch_size and crit_dp == dp
        crit_ok = mini_ok if same else samples_divide("critic.ppo_mini_batch_size", crit_mb, crit_dp, where)
        if crit_mb > 0 and train % crit_mb and crit_mb != actor.ppo_mini_batch_size:
            problems.append(
                f"data.train_batch_size={train} is not a multiple of critic.ppo_mini_batch_size={crit_mb}."
            )
        crit_seqs = crit_mb * n // crit_dp
        crit_micro = cfg.critic.ppo_micro_batch_size_per_gpu
        if crit_ok and not cfg.critic.use_dynamic_bsz and (crit_micro <= 0 or crit_seqs % crit_micro):
            problems.append(
                f"critic.ppo_micro_batch_size_per_gpu={crit_micro} must be positive and divide "
                f"critic.ppo_mini_batch_size x rollout.n / data-parallel size = {crit_seqs}."
            )
    if len(problems) > 1:
        raise ConfigErrors(problems)
    if problems:
        raise ConfigError(problems[0])
