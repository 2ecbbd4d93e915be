"""One PPO update of the actor and the critic, and the forward passes that feed it.

Shapes: B sequences on this data-parallel rank, P prompt tokens (left padded), R response tokens
(right padded), S = P + R, V the vocabulary (V_pad/TP per tensor-parallel rank).

Forward passes (no grad, micro-batched through megatron's pipeline schedule):

    compute_log_probs(actor|ref)  input_ids [B, S] -> decoder output at positions P-1 .. S-2 only
                                  -> logits [b, R, V_pad/TP] / temperature -> log p(responses) [B, R]
                                  (vocab-parallel softmax, see models/logprobs.py), broadcast to every stage
    compute_values(critic)        -> values [b, S, 1] -> values[:, P-1 : S-1] -> [B, R]

Response token t sits at position P+t of input_ids and is predicted from position P+t-1, so both the
log-prob and the value of token t come from position P+t-1.

One update (:func:`update_actor` / :func:`update_critic`), for each of ppo_epochs passes:

    batch [B]  --mini-batches-->  ppo_mini_batch_size * rollout.n / DP sequences each (one optimizer step)
               --micro-batches--> ppo_micro_batch_size_per_gpu sequences each, or with use_dynamic_bsz
                                  length-sorted groups within ppo_max_token_len_per_gpu tokens, each row
                                  compacted to its real tokens, [b, longest sequence] (microbatches.py)

On the last pipeline stage each micro-batch's loss is an additive share of the mini-batch loss: the
aggregation (token-mean, seq-mean-*) divides by the count over the WHOLE mini-batch on all DP ranks
(``global_denominator``), and megatron's DDP sums gradients over DP (``calculate_per_token_loss``). The
summed micro-batch gradients are therefore exactly the gradient of the mini-batch mean loss, whatever
the layout or the micro-batch split.

    actor loss  = pg_loss(old_log_probs, log_probs, advantages; clip low/high, dual-clip c)
                  - entropy_coeff * entropy + kl_loss_coef * KL(log_probs, ref_log_probs)
    critic loss = 0.5 * max((v - R)^2, (clip(v, V_old +- cliprange_value) - R)^2)

Metrics are the same shares summed over micro-batches and DP ranks (mini-batch values), averaged over
mini-batches and epochs, and broadcast from the last stage, so every rank returns the same dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.algos import (
    PolicyLossOptions,
    agg_loss,
    compute_policy_loss,
    compute_value_loss,
    effective_agg_mode,
    kl_penalty,
    masked_mean,
)
from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ActorConfig, ConfigError, CriticConfig
from megatron_rl.microbatches import MicroBatching, TokenStats, micro_batches
from megatron_rl.models.forward import (
    Positions,
    broadcast_from_last_stage,
    run_pipeline,
    select_positions,
    sequence_multiple,
)
from megatron_rl.models.logprobs import vocab_parallel_log_probs_and_entropy
from megatron_rl.models.moe_metrics import RouterStats
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import ParallelState

# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------


def _response_positions(mb: RolloutBatch) -> Positions:
    return mb.response_positions


def _micro(micro: int | MicroBatching) -> MicroBatching:
    return micro if isinstance(micro, MicroBatching) else MicroBatching(size=micro)


def _split(
    model: nn.Module, ps: ParallelState, batch: RolloutBatch, micro: MicroBatching, stats: TokenStats | None
) -> tuple[list[RolloutBatch], list[list[int]]]:
    """``batch``'s micro-batches (and their rows) for ``model``'s forward (padded to TP under SP)."""
    return micro_batches(batch, micro, sequence_multiple(model, ps), ps.dp_group, ps.device, stats)


@torch.no_grad()
def _forward_response(
    model: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    per_micro_batch: Callable[[RolloutBatch, torch.Tensor], torch.Tensor],
    rows: int,
    positions: Callable[[RolloutBatch], Positions] | None = None,
    stats: TokenStats | None = None,
) -> torch.Tensor:
    """Run ``batch`` through the pipeline; ``per_micro_batch(mb, output) -> [rows, b, r]`` on the last
    stage (r: the micro-batch's response width); returns [rows, B, R] float32 on every rank, 0 past
    each sequence's last response token (whatever the micro-batching)."""
    n, r = len(batch), batch.response_length
    mbs, groups = _split(model, ps, batch, _micro(micro), stats)
    outs = run_pipeline(model, ps, mbs, per_micro_batch, forward_only=True, positions=positions)
    result = None
    if ps.is_last_stage:
        result = torch.zeros(rows, n, r, dtype=torch.float32, device=ps.device)
        for out, index in zip(outs, groups, strict=True):  # the fixed path's filler rows are dropped
            result[:, index, : out.shape[2]] = out[:, : len(index)]
        result *= batch.attention_mask[:, -r:].to(result.dtype)  # [B, R]: 1 on real response tokens
    return broadcast_from_last_stage(result, ps, (rows, n, r), torch.float32)


def compute_log_probs(
    model: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: TokenStats | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, R] float32 of ``batch.responses`` under ``model`` (actor or reference), on every rank.

    ``micro``: sequences per micro-batch, or a :class:`~megatron_rl.microbatches.MicroBatching`. Logits
    are divided by ``temperature`` (the rollout's sampling temperature) before the softmax; with
    ``with_entropy`` the per-token entropy [B, R] is returned too. ``stats`` counts the tokens.
    """
    vocab = model.args.vocab_size

    def per_micro_batch(mb: RolloutBatch, logits: torch.Tensor) -> torch.Tensor:
        # logits [b, r, V_pad/TP] of positions p-1 .. s-2; position p+t-1 predicts response token t.
        out = vocab_parallel_log_probs_and_entropy(
            logits, mb.responses, ps, vocab, temperature, with_entropy=with_entropy
        )
        return torch.stack(out) if with_entropy else out[None]  # [2 or 1, b, R]

    rows = 2 if with_entropy else 1
    res = _forward_response(model, ps, batch, micro, per_micro_batch, rows, _response_positions, stats)
    return (res[0], res[1]) if with_entropy else res[0]


def compute_values(
    critic: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    stats: TokenStats | None = None,
) -> torch.Tensor:
    """Critic values [B, R] float32 of each response token (output at the preceding position), every rank."""

    def per_micro_batch(mb: RolloutBatch, values: torch.Tensor) -> torch.Tensor:
        return select_positions(values[..., 0], mb.response_positions, seq_first=False)[
            None
        ].float()  # [1, b, r]

    return _forward_response(critic, ps, batch, micro, per_micro_batch, 1, stats=stats)[0]


# --------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------


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


def _global_counts(mask: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """[masked tokens, sequences with >= 1 masked token] of a mini-batch, summed over DP ranks."""
    counts = torch.stack([mask.sum(), (mask.sum(dim=-1) > 0).sum().to(mask.dtype)]).float()
    if ps.dp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=ps.dp_group)
    return counts


def _denominator(counts: torch.Tensor, loss_agg_mode: str) -> torch.Tensor | float:
    """The mini-batch count ``agg_loss`` divides by: tokens, sequences, or nothing for token-sum."""
    if loss_agg_mode == "token-sum":
        return 1.0
    return counts[0] if loss_agg_mode == "token-mean" else counts[1]


def _run_update(
    model: nn.Module,
    optimizer: ModelOptimizer,
    ps: ParallelState,
    batch: RolloutBatch,
    *,
    rows: int,
    micro: MicroBatching,
    epochs: int,
    shuffle: bool,
    shuffle_seed: int,
    names: list[str],
    make_loss_fn: Callable[[torch.Tensor], Callable[[RolloutBatch, torch.Tensor], Any]],
    prefix: str,
    key: str,
    positions: Callable[[RolloutBatch], Positions] | None = None,
    stats: TokenStats | None = None,
) -> dict[str, float]:
    """epochs x mini-batches x micro-batches; ``make_loss_fn(counts)`` builds a mini-batch's loss_fn,
    which returns (loss share, num tokens, metric shares [len(names)]). ``positions``: see
    :func:`~megatron_rl.models.forward.run_pipeline`."""
    if epochs < 1:
        raise ConfigError(f"{key}.ppo_epochs must be >= 1, got {epochs}")
    model.train()
    shares = torch.zeros(len(names), dtype=torch.float32, device=ps.device)
    grad_norms, lrs = [], []
    skipped0, scaler_skips0 = optimizer.skipped_steps, optimizer.loss_scale_skips
    n_mini = len(batch) // rows
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(
                len(batch), generator=torch.Generator().manual_seed(shuffle_seed * 1000 + epoch)
            )
        else:
            order = torch.arange(len(batch))
        for j in range(n_mini):
            mini = batch.select(order[j * rows : (j + 1) * rows])
            counts = _global_counts(mini.response_mask, ps)
            optimizer.zero_grad()
            outs = run_pipeline(
                optimizer.ddp,
                ps,
                _split(model, ps, mini, micro, stats)[0],
                make_loss_fn(counts),
                forward_only=False,
                positions=positions,
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
    shares = broadcast_from_last_stage(shares, ps, shares.shape, shares.dtype) / (epochs * n_mini)
    metrics = {f"{prefix}/{name}": v for name, v in zip(names, shares.tolist(), strict=True)}
    for alias, name in (("actor/entropy_loss", "actor/entropy"), ("critic/loss", "critic/vf_loss")):
        if name in metrics:  # verl's other names for the same values
            metrics[alias] = metrics[name]
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


def update_actor(
    model: nn.Module,
    optimizer: ModelOptimizer,
    ps: ParallelState,
    batch: RolloutBatch,
    cfg: ActorConfig,
    rollout_n: int,
    temperature: float = 1.0,
    shuffle_seed: int = 0,
    stats: TokenStats | None = None,
) -> dict[str, float]:
    """One PPO update of the actor on this rank's share of the rollout batch (see the module docstring).

    ``batch`` tensors live on ``ps.device``. Uses batch.input_ids, attention_mask, responses,
    response_mask, old_log_probs, advantages, rollout_is_weights when set and, with ``cfg.use_kl_loss``,
    ref_log_probs. The policy loss is ``cfg.policy_loss.loss_mode``'s (algos/policy_loss.py).
    ``temperature`` is the rollout's sampling temperature; ``shuffle_seed`` (e.g. the global step)
    seeds the mini-batch order when ``cfg.shuffle``.
    Returns actor/loss, pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, [kl_loss], grad_norm (of
    the finite steps), lr, nonfinite_grad_steps.
    """
    key = "actor_rollout_ref.actor"
    for name in ("old_log_probs", "advantages") + (("ref_log_probs",) if cfg.use_kl_loss else ()):
        if getattr(batch, name) is None:
            raise ValueError(f"update_actor: batch.{name} is not set (compute it before the update)")
    micro = MicroBatching.of(
        cfg.ppo_micro_batch_size_per_gpu,
        cfg.use_dynamic_bsz,
        cfg.ppo_max_token_len_per_gpu,
        f"{key}.ppo_max_token_len_per_gpu",
    )
    rows = _mini_batch_rows(batch, cfg.ppo_mini_batch_size, micro, rollout_n, ps.dp_size, key)
    vocab = model.args.vocab_size
    low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
    high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
    names = ["loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy"]
    if cfg.use_kl_loss:
        names.append("kl_loss")
    loss_mode = cfg.policy_loss.loss_mode
    options = PolicyLossOptions(
        clip_cov_ratio=cfg.policy_loss.clip_cov_ratio,
        clip_cov_lb=cfg.policy_loss.clip_cov_lb,
        clip_cov_ub=cfg.policy_loss.clip_cov_ub,
        kl_cov_ratio=cfg.policy_loss.kl_cov_ratio,
        ppo_kl_coef=cfg.policy_loss.ppo_kl_coef,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
    )
    # seq-mean-token-sum-norm divides by a constant, never a micro-batch's own width
    scale = cfg.loss_scale_factor or float(batch.response_length)
    # clip_cov picks tokens at random: the TP/PP peers of one replica draw the same (same seed, same data).
    generator = torch.Generator().manual_seed(shuffle_seed * 7919 + ps.dp_rank)

    def make_loss_fn(counts: torch.Tensor):
        denom = _denominator(counts, cfg.loss_agg_mode)
        pg_denom = _denominator(counts, effective_agg_mode(loss_mode, cfg.loss_agg_mode))
        tokens = counts[0]

        def loss_fn(mb: RolloutBatch, logits: torch.Tensor):
            mask = mb.response_mask
            # logits [b, r, V_pad/TP]: the head ran on positions p-1 .. s-2 only
            log_probs, entropy = vocab_parallel_log_probs_and_entropy(
                logits, mb.responses, ps, vocab, temperature, with_entropy=True
            )
            pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
                mb.old_log_probs,
                log_probs,
                mb.advantages,
                mask,
                clip_ratio=cfg.clip_ratio,
                clip_ratio_low=low,
                clip_ratio_high=high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode,
                global_denominator=pg_denom,
                loss_mode=loss_mode,
                options=options,
                rollout_is_weights=mb.rollout_is_weights,
                loss_scale_factor=scale,
                generator=generator,
            )
            ent = agg_loss(entropy, mask, cfg.loss_agg_mode, denom, scale)
            loss = pg_loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else pg_loss
            # Diagnostics are token means over the mini-batch: local mean x local tokens / global tokens.
            weight = mask.sum() / tokens.clamp_min(1)
            metrics = [
                loss.detach(),
                pg_loss.detach(),
                clipfrac * weight,
                clipfrac_lower * weight,
                ppo_kl * weight,
                ent.detach(),
            ]
            if cfg.use_kl_loss:
                kld = kl_penalty(log_probs, mb.ref_log_probs, cfg.kl_loss_type)
                kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, denom, scale)
                loss = loss + cfg.kl_loss_coef * kl_loss
                metrics[0] = loss.detach()
                metrics.append(kl_loss.detach())
            return loss, mask.sum().int(), torch.stack(metrics).float()

        return loss_fn

    with RouterStats(model, ps, "actor") as router:  # MoE: aux/z-loss and expert load; dense: nothing
        metrics = _run_update(
            model,
            optimizer,
            ps,
            batch,
            rows=rows,
            micro=micro,
            epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            shuffle_seed=shuffle_seed,
            names=names,
            make_loss_fn=make_loss_fn,
            prefix="actor",
            key=key,
            positions=_response_positions,
            stats=stats,
        )
    metrics.update(router.metrics())
    return metrics


def update_critic(
    critic: nn.Module,
    optimizer: ModelOptimizer,
    ps: ParallelState,
    batch: RolloutBatch,
    cfg: CriticConfig,
    rollout_n: int,
    shuffle_seed: int = 0,
    stats: TokenStats | None = None,
) -> dict[str, float]:
    """One PPO update of the critic (clipped value loss) on this rank's share of the rollout batch.

    ``batch`` tensors live on ``ps.device``. Uses batch.values (V_old) and batch.returns besides the
    tokens and masks.

    Returns critic/vf_loss, vf_clipfrac, vpred_mean, grad_norm (of the finite steps), lr,
    nonfinite_grad_steps.
    """
    for name in ("values", "returns"):
        if getattr(batch, name) is None:
            raise ValueError(f"update_critic: batch.{name} is not set (compute it before the update)")
    if cfg.ppo_mini_batch_size is None or cfg.ppo_epochs is None:
        raise ConfigError(
            "critic.ppo_mini_batch_size / critic.ppo_epochs are unset: load the config with load_config"
        )
    micro = MicroBatching.of(
        cfg.ppo_micro_batch_size_per_gpu,
        cfg.use_dynamic_bsz,
        cfg.ppo_max_token_len_per_gpu,
        "critic.ppo_max_token_len_per_gpu",
    )
    rows = _mini_batch_rows(batch, cfg.ppo_mini_batch_size, micro, rollout_n, ps.dp_size, "critic")
    width = float(batch.response_length)  # seq-mean-token-sum-norm's constant (the batch's response width)

    def make_loss_fn(counts: torch.Tensor):
        denom = _denominator(counts, cfg.loss_agg_mode)
        tokens = counts[0]

        def loss_fn(mb: RolloutBatch, out: torch.Tensor):
            mask = mb.response_mask
            vpreds = select_positions(out[..., 0], mb.response_positions, seq_first=False).float()  # [b, r]
            vf_loss, clipfrac = compute_value_loss(
                vpreds,
                values=mb.values,
                returns=mb.returns,
                response_mask=mask,
                cliprange_value=cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode,
                global_denominator=denom,
                loss_scale_factor=width,
            )
            weight = mask.sum() / tokens.clamp_min(1)
            vpred_mean = masked_mean(vpreds.detach(), mask) * weight
            metrics = torch.stack([vf_loss.detach(), clipfrac * weight, vpred_mean]).float()
            return vf_loss, mask.sum().int(), metrics

        return loss_fn

    return _run_update(
        critic,
        optimizer,
        ps,
        batch,
        rows=rows,
        micro=micro,
        epochs=cfg.ppo_epochs,
        shuffle=cfg.shuffle,
        shuffle_seed=shuffle_seed,
        names=["vf_loss", "vf_clipfrac", "vpred_mean"],
        make_loss_fn=make_loss_fn,
        prefix="critic",
        key="critic",
        stats=stats,
    )
