"""The PPO update loop: one for both roles. ppo.py's update_actor and update_critic give it their loss.

One update, for each of ppo_epochs passes:

    batch [B]  --mini-batches-->  ppo_mini_batch_size * rollout.n / DP sequences each (one optimizer step)
               --micro-batches--> ppo_micro_batch_size_per_gpu sequences each, or with use_dynamic_bsz
                                  length-sorted groups within ppo_max_token_len_per_gpu tokens, each row
                                  compacted to its real tokens, [b, longest sequence] (microbatches.py)

What differs between the roles is a :class:`RoleLoss`: the micro-batch loss and the metrics it returns
(their names, the role's metric prefix), and how the model's output is formed (``positions`` and
``head`` of :func:`~megatron_rl.models.forward.run_pipeline`); the model and optimizer are the role's.
The config keys the loop reads have the same names under both roles' sections; what they decide together
(the aggregation, its loss scale, the clip bounds) is a :class:`~megatron_rl.config.specs.UpdateSpec`.

On the last pipeline stage each micro-batch's loss is an additive share of the mini-batch loss: the
aggregation (token-mean, seq-mean-*) divides by the count over the WHOLE mini-batch on all DP ranks
(:class:`MiniBatch` gives it to the loss as ``global_denominator``), and megatron's DDP sums gradients
over DP (``calculate_per_token_loss``). The summed micro-batch gradients are therefore exactly the
gradient of the mini-batch mean loss, whatever the layout or the micro-batch split.

Metrics are the same shares summed over micro-batches and DP ranks (mini-batch values), averaged over
mini-batches and epochs, and broadcast from the last stage, so every rank returns the same dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl import seeds
from megatron_rl.algos import agg_loss
from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ActorConfig, ConfigError, CriticConfig
from megatron_rl.config.specs import UpdateSpec
from megatron_rl.microbatches import MicroBatching, TokenStats, micro_batches
from megatron_rl.models.chunks import num_chunks
from megatron_rl.models.forward import (
    Positions,
    broadcast_from_last_stage,
    packs,
    run_pipeline,
    sequence_multiple,
)
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import ParallelState

Head = Callable[[RolloutBatch, torch.Tensor, torch.Tensor], torch.Tensor]
"""run_pipeline's ``head``: (micro-batch, hidden [r, b, h], LM-head weight) -> the output [b, r, k]."""


def split(
    model: nn.Module, ps: ParallelState, batch: RolloutBatch, micro: MicroBatching, stats: TokenStats | None
) -> tuple[list[RolloutBatch], list[list[int]]]:
    """``batch``'s micro-batches (and their rows) for ``model``'s forward (padded to TP under SP;
    interleaved pipelines: token-budget micro-batches made a multiple of PP in count)."""
    count = ps.pp_size if num_chunks(model) > 1 else 1
    multiple = sequence_multiple(model, ps)
    return micro_batches(batch, micro, multiple, ps.dp_group, ps.device, stats, count, packs(model))


@dataclass(frozen=True)
class UpdatePlan:
    """How one update walks its batch: ``epochs`` passes of mini-batches of ``rows`` sequences (this
    rank's), each split into ``micro``-batches, in a shuffled order when ``shuffle``."""

    key: str
    """The config section, as errors name it (``actor_rollout_ref.actor``, ``critic``)."""
    micro: MicroBatching
    rows: int
    epochs: int
    shuffle: bool
    spec: UpdateSpec
    """The aggregation, its loss scale and the clip bounds (config.specs: the same on every DP rank)."""

    @classmethod
    def of(
        cls,
        batch: RolloutBatch,
        cfg: ActorConfig | CriticConfig,
        rollout_n: int,
        dp_size: int,
        key: str,
        caller: str,
        needs: tuple[str, ...],
    ) -> UpdatePlan:
        """The plan of ``cfg`` (section ``key``) over ``batch``; ``caller`` refuses a batch without one
        of the fields ``needs`` names."""
        for name in needs:
            if getattr(batch, name) is None:
                raise ValueError(f"{caller}: batch.{name} is not set (compute it before the update)")
        if cfg.ppo_mini_batch_size is None or cfg.ppo_epochs is None:
            raise ConfigError(
                f"{key}.ppo_mini_batch_size / {key}.ppo_epochs are unset: load the config with load_config"
            )
        micro = MicroBatching.of(
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.use_dynamic_bsz,
            cfg.ppo_max_token_len_per_gpu,
            f"{key}.ppo_max_token_len_per_gpu",
        )
        rows = _mini_batch_rows(batch, cfg.ppo_mini_batch_size, micro, rollout_n, dp_size, key)
        return cls(key, micro, rows, cfg.ppo_epochs, cfg.shuffle, UpdateSpec.of(cfg, key))


def _mini_batch_rows(
    batch: RolloutBatch, mini_batch_size: int, micro: MicroBatching, rollout_n: int, dp_size: int, key: str
) -> int:
    """Sequences per rank per mini-batch; checks that mini- and micro-batches tile the batch."""
    total = mini_batch_size * rollout_n
    if mini_batch_size <= 0 or total % dp_size:
        raise ConfigError(
            f"{key}.ppo_mini_batch_size={mini_batch_size} x rollout.n={rollout_n} must be a positive "
            f"multiple of the data-parallel size {dp_size}."
        )
    rows = total // dp_size
    if len(batch) % rows:
        raise ConfigError(
            f"this rank holds {len(batch)} sequences, not a multiple of {key}.ppo_mini_batch_size x "
            f"rollout.n / DP = {rows}: make data.train_batch_size a multiple of {key}.ppo_mini_batch_size."
        )
    if not micro.dynamic and (micro.size <= 0 or rows % micro.size):
        raise ConfigError(
            f"{key}.ppo_micro_batch_size_per_gpu={micro.size} must divide the {rows} sequences per "
            f"rank of a mini-batch ({key}.ppo_mini_batch_size x rollout.n / DP)."
        )
    return rows


@dataclass(frozen=True)
class MiniBatch:
    """The mini-batch in flight, as its micro-batches' loss sees it: its counts over all DP ranks, which
    make every micro-batch's loss and metrics additive shares of the mini-batch's, and the rows of the
    update's batch each micro-batch holds."""

    counts: torch.Tensor
    """[response tokens, sequences with >= 1 of them], summed over DP ranks."""
    plan: UpdatePlan
    rows_of: dict[int, torch.Tensor] = field(default_factory=dict)
    """id(micro-batch) -> the rows of the update's batch it holds (filler rows not listed)."""

    def denominator(self, loss_agg_mode: str | None = None) -> torch.Tensor | float:
        """The mini-batch count the aggregation ``loss_agg_mode`` (default: the plan's) divides by:
        tokens, sequences, or nothing for token-sum."""
        mode = self.plan.spec.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
        if mode == "token-sum":
            return 1.0
        return self.counts[0] if mode == "token-mean" else self.counts[1]

    def agg(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the mini-batch aggregate of per-token ``values`` [b, r]."""
        spec = self.plan.spec
        return agg_loss(values, mask, spec.loss_agg_mode, self.denominator(), spec.loss_scale)

    def token_share(self, mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the mini-batch's tokens: a local token mean times it is the share of
        the mini-batch token mean."""
        return mask.sum() / self.counts[0].clamp_min(1)


MicroBatchLoss = Callable[[RolloutBatch, torch.Tensor, MiniBatch], tuple[torch.Tensor, list[torch.Tensor]]]
"""(micro-batch, the last stage's output, its mini-batch) -> (its share of the mini-batch loss, its
shares of the metrics, one scalar per name of :attr:`RoleLoss.names`)."""


@dataclass(frozen=True)
class RoleLoss:
    """What one role's update computes: ``loss`` on each micro-batch's output, formed by ``positions`` and
    ``head`` (see :func:`~megatron_rl.models.forward.run_pipeline`); metrics ``{role}/{name}``."""

    role: str
    names: tuple[str, ...]
    loss: MicroBatchLoss
    aliases: Mapping[str, str] = field(default_factory=dict)
    """verl's other names of some metrics: alias -> name (both logged)."""
    positions: Callable[[RolloutBatch], Positions] | None = None
    head: Head | None = None


def _global_counts(mask: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """[masked tokens, sequences with >= 1 masked token] of a mini-batch, summed over DP ranks."""
    counts = torch.stack([mask.sum(), (mask.sum(dim=-1) > 0).sum().to(mask.dtype)]).float()
    if ps.dp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=ps.dp_group)
    return counts


def _loss_fn(
    loss: MicroBatchLoss, mini: MiniBatch
) -> Callable[[RolloutBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """run_pipeline's loss_fn of the micro-batches of ``mini``: (loss share, tokens, metric shares)."""

    def loss_fn(mb: RolloutBatch, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        value, metrics = loss(mb, out, mini)
        return value, mb.response_mask.sum().int(), torch.stack(metrics).float()

    return loss_fn


def run_update(
    model: nn.Module,
    optimizer: ModelOptimizer,
    ps: ParallelState,
    batch: RolloutBatch,
    plan: UpdatePlan,
    role: RoleLoss,
    shuffle_seed: int = 0,
    stats: TokenStats | None = None,
) -> dict[str, float]:
    """One PPO update of ``model`` (its ``optimizer`` steps once per mini-batch) on this rank's
    ``batch``: epochs x mini-batches x micro-batches (see the module docstring). ``shuffle_seed`` (e.g.
    the global step) seeds the mini-batch order when ``plan.shuffle``; ``stats`` counts the tokens.

    Returns ``{role}/{name}`` of the loss's metrics (and their aliases), grad_norm (of the finite
    steps), lr, nonfinite_grad_steps, with fp16 loss_scale and loss_scale_skips, with a bf16/fp16 model
    param_update_frac.
    """
    if plan.epochs < 1:
        raise ConfigError(f"{plan.key}.ppo_epochs must be >= 1, got {plan.epochs}")
    model.train()
    prefix, rows = role.role, plan.rows
    shares = torch.zeros(len(role.names), dtype=torch.float32, device=ps.device)
    grad_norms, lrs = [], []
    skipped0, scaler_skips0 = optimizer.skipped_steps, optimizer.loss_scale_skips
    n_mini = len(batch) // rows
    for epoch in range(plan.epochs):
        if plan.shuffle:
            order = torch.randperm(
                len(batch),
                generator=torch.Generator().manual_seed(
                    seeds.derive(seeds.UPDATE_ORDER, shuffle_seed, epoch)
                ),
            )
        else:
            order = torch.arange(len(batch))
        for j in range(n_mini):
            index = order[j * rows : (j + 1) * rows]
            mini = batch.select(index)
            counts = _global_counts(mini.response_mask, ps)
            mbs, groups = split(model, ps, mini, plan.micro, stats)
            rows_of = {id(mb): index[g] for mb, g in zip(mbs, groups, strict=True)}
            optimizer.zero_grad()
            outs = run_pipeline(
                optimizer.ddp,
                ps,
                mbs,
                _loss_fn(role.loss, MiniBatch(counts, plan, rows_of)),
                forward_only=False,
                positions=role.positions,
                head=role.head,
            )
            for m in outs:  # last stage only
                shares += m
            norm, lr = optimizer.step()  # a non-finite norm (or an fp16 overflow) skips the step
            if math.isfinite(norm):
                grad_norms.append(norm)
            lrs.append(lr)
    # Mini-batch values = shares summed over DP; then the mean over mini-batches and epochs.
    if ps.dp_size > 1:
        dist.all_reduce(shares, op=dist.ReduceOp.SUM, group=ps.dp_group)
    shares = broadcast_from_last_stage(shares, ps, shares.shape, shares.dtype) / (plan.epochs * n_mini)
    metrics = {f"{prefix}/{name}": v for name, v in zip(role.names, shares.tolist(), strict=True)}
    for alias, name in role.aliases.items():
        metrics[f"{prefix}/{alias}"] = metrics[f"{prefix}/{name}"]
    metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    metrics[f"{prefix}/lr"] = sum(lrs) / len(lrs)
    # optimizer steps skipped for a non-finite loss or gradient that the fp16 loss scaler could not
    # fix (the norm and the scale are the same on every rank, so are these counts)
    metrics[f"{prefix}/nonfinite_grad_steps"] = float(optimizer.skipped_steps - skipped0)
    if optimizer.loss_scale is not None:  # fp16: the scaler's own skips are routine, not failures
        metrics[f"{prefix}/loss_scale"] = optimizer.loss_scale
        metrics[f"{prefix}/loss_scale_skips"] = float(optimizer.loss_scale_skips - scaler_skips0)
    updated = optimizer.pop_update_fraction()
    if updated is not None:  # bf16/fp16 models: how much of the model the update actually moved
        metrics[f"{prefix}/param_update_frac"] = updated
    return metrics
