"""One PPO update of the actor and the critic, and the forward passes that feed it.

Shapes: B sequences on this data-parallel rank, P prompt tokens (left padded), R response tokens
(right padded), S = P + R, V the vocabulary (V_pad/TP per tensor-parallel rank).

Forward passes (no grad, micro-batched through megatron's pipeline schedule):

    compute_log_probs(actor|ref)  input_ids [B, S] -> final hidden states at positions P-1 .. S-2 only
                                  [R, b, h] -> LM head fused with the vocab-parallel log-softmax, chunked
                                  (no [b, R, V_pad/TP] logits; models/logprobs.py) -> log p [B, R]
    compute_values(critic)        -> values [b, S, 1] -> values[:, P-1 : S-1] -> [B, R]

Response token t sits at position P+t of input_ids and is predicted from position P+t-1, so both the
log-prob and the value of token t come from position P+t-1. The update's forward uses the same fused
head (its backward recomputes each chunk's logits). When roles.actor.old_log_prob_is_first_forward holds,
the old-log-prob pass is skipped and the update takes its first forward, detached, as old_log_probs.

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
from typing import Any, Literal, overload

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
from megatron_rl.microbatches import MicroBatching, TokenStats, micro_batches, response_keep
from megatron_rl.models import routing
from megatron_rl.models.forward import (
    Positions,
    broadcast_from_last_stage,
    run_pipeline,
    select_positions,
    sequence_multiple,
)
from megatron_rl.models.logprobs import DEFAULT_CHUNK_TOKENS, fused_log_probs_and_entropy
from megatron_rl.models.moe_metrics import RouterStats
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import ParallelState

# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------


def _response_positions(mb: RolloutBatch) -> Positions:
    return mb.response_positions


def _log_prob_head(
    ps: ParallelState, vocab: int, temperature: float, with_entropy: bool, entropy_grad: bool, chunk: int
) -> Callable[[RolloutBatch, torch.Tensor, torch.Tensor], torch.Tensor]:
    """run_pipeline's ``head`` of the log-prob passes: hidden [r, b, h] of positions p-1 .. s-2 and the
    weight [V_pad/TP, h] -> [r, b, 1 or 2] (log p, entropy) of the responses, fused and chunked."""

    def head(mb: RolloutBatch, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = fused_log_probs_and_entropy(
            hidden,
            weight,
            mb.responses.T,  # [r, b]: position p+t-1 predicts response token t
            ps,
            vocab,
            temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=chunk,
        )
        return torch.stack(out, dim=-1) if with_entropy else out[..., None]

    return head


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
    head: Callable[[RolloutBatch, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``batch`` through the pipeline (``head``: see run_pipeline); ``per_micro_batch(mb, output)
    -> [rows, b, r]`` on the last stage (r: the micro-batch's response width); returns [rows, B, R]
    float32 on every rank, 0 past each sequence's last response token (whatever the micro-batching)."""
    mbs, groups = _split(model, ps, batch, _micro(micro), stats)
    routing.planned(model, batch, mbs, groups, sequence_multiple(model, ps))  # R2 maps its record back
    outs = run_pipeline(model, ps, mbs, per_micro_batch, forward_only=True, positions=positions, head=head)
    # the last stage's outputs (none elsewhere); the fixed path's filler rows are dropped
    parts = [(i, out[:, : len(i)]) for out, i in zip(outs, groups, strict=True)] if ps.is_last_stage else []
    return _assemble(parts, batch, ps, rows)


def _assemble(parts: list, batch: RolloutBatch, ps: ParallelState, k: int) -> torch.Tensor:
    """(rows of ``batch``, values [k, rows, r]) per micro-batch of the last stage -> [k, B, R] float32 on
    every stage, 0 past each sequence's last response token (whatever the micro-batching)."""
    n, r = len(batch), batch.response_length
    result = None
    if ps.is_last_stage:
        result = torch.zeros(k, n, r, dtype=torch.float32, device=ps.device)
        for index, values in parts:
            result[:, index, : values.shape[2]] = values
        result *= batch.attention_mask[:, -r:].to(result.dtype)  # [B, R]: 1 on real response tokens
    return broadcast_from_last_stage(result, ps, (k, n, r), torch.float32)


@overload
def compute_log_probs(
    model: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    temperature: float = ...,
    with_entropy: Literal[False] = ...,
    stats: TokenStats | None = ...,
    chunk_tokens: int = ...,
) -> torch.Tensor: ...
@overload
def compute_log_probs(
    model: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    temperature: float = ...,
    *,
    with_entropy: Literal[True],
    stats: TokenStats | None = ...,
    chunk_tokens: int = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
def compute_log_probs(
    model: nn.Module,
    ps: ParallelState,
    batch: RolloutBatch,
    micro: int | MicroBatching,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: TokenStats | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, R] float32 of ``batch.responses`` under ``model`` (actor or reference), on every rank.

    ``micro``: sequences per micro-batch, or a :class:`~megatron_rl.microbatches.MicroBatching`. Logits
    are divided by ``temperature`` (the rollout's sampling temperature) before the softmax. With
    ``with_entropy`` the per-token entropy [B, R] of the same distributions comes too, as
    ``(log_probs, entropy)``. ``stats`` counts the tokens. The LM head runs fused with the log-softmax,
    ``chunk_tokens`` tokens at a time (models/logprobs.py).
    """
    head = _log_prob_head(ps, model.args.vocab_size, temperature, with_entropy, False, chunk_tokens)

    def per_micro_batch(mb: RolloutBatch, out: torch.Tensor) -> torch.Tensor:
        return out.permute(2, 0, 1)  # [b, r, 1 or 2] -> [1 or 2, b, r]

    rows = 2 if with_entropy else 1
    res = _forward_response(
        model, ps, batch, micro, per_micro_batch, rows, _response_positions, stats, head=head
    )
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
# The old-log-prob pass, when the update's first forward gives the same values
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
    head: Callable[[RolloutBatch, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    rows_of: dict[int, torch.Tensor] | None = None,
) -> dict[str, float]:
    """epochs x mini-batches x micro-batches; ``make_loss_fn(counts)`` builds a mini-batch's loss_fn,
    which returns (loss share, num tokens, metric shares [len(names)]). ``positions``, ``head``: see
    :func:`~megatron_rl.models.forward.run_pipeline`. ``rows_of`` is filled, for the mini-batch in
    flight, with id(micro-batch) -> the rows of ``batch`` it holds (filler rows not listed)."""
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
            index = order[j * rows : (j + 1) * rows]
            mini = batch.select(index)
            counts = _global_counts(mini.response_mask, ps)
            mbs, groups = _split(model, ps, mini, micro, stats)
            if rows_of is not None:
                rows_of.clear()
                rows_of.update({id(mb): index[g] for mb, g in zip(mbs, groups, strict=True)})
            optimizer.zero_grad()
            outs = run_pipeline(
                optimizer.ddp,
                ps,
                mbs,
                make_loss_fn(counts),
                forward_only=False,
                positions=positions,
                head=head,
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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> dict[str, float]:
    """One PPO update of the actor on this rank's share of the rollout batch (see the module docstring).

    ``batch`` tensors live on ``ps.device``. Uses batch.input_ids, attention_mask, responses,
    response_mask, old_log_probs, advantages, rollout_is_weights when set and, with ``cfg.use_kl_loss``,
    ref_log_probs. The policy loss is ``cfg.policy_loss.loss_mode``'s (algos/policy_loss.py).
    ``temperature`` is the rollout's sampling temperature; ``shuffle_seed`` (e.g. the global step)
    seeds the mini-batch order when ``cfg.shuffle``. ``chunk_tokens``: tokens per chunk of the fused
    LM head and log-softmax (models/logprobs.py).

    ``batch.old_log_probs = None`` (one mini-batch, one epoch: see roles.actor.old_log_prob_is_first_forward)
    takes the update's own forward, detached, as the old log-probs (the ratio is exactly 1), and
    stores them on ``batch.old_log_probs`` afterwards ([B, R], 0 past each response, as
    :func:`compute_log_probs` gives them).
    Returns actor/loss, pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, [kl_loss], grad_norm (of
    the finite steps), lr, nonfinite_grad_steps.
    """
    key = "actor_rollout_ref.actor"
    for name in ("advantages",) + (("ref_log_probs",) if cfg.use_kl_loss else ()):
        if getattr(batch, name) is None:
            raise ValueError(f"update_actor: batch.{name} is not set (compute it before the update)")
    micro = MicroBatching.of(
        cfg.ppo_micro_batch_size_per_gpu,
        cfg.use_dynamic_bsz,
        cfg.ppo_max_token_len_per_gpu,
        f"{key}.ppo_max_token_len_per_gpu",
    )
    rows = _mini_batch_rows(batch, cfg.ppo_mini_batch_size, micro, rollout_n, ps.dp_size, key)
    first_forward = batch.old_log_probs is None
    if first_forward and (cfg.ppo_epochs != 1 or rows != len(batch)):
        raise ValueError(
            f"update_actor: batch.old_log_probs is not set, but {key}.ppo_epochs={cfg.ppo_epochs} and "
            f"{len(batch) // rows} mini-batches ({key}.ppo_mini_batch_size) need them: compute them "
            f"before the update (only ppo_epochs=1 with one mini-batch per step may skip that pass)."
        )
    rows_of: dict[int, torch.Tensor] = {}
    first: list[tuple[torch.Tensor, torch.Tensor]] = []  # (batch rows, their detached log-probs [1, n, r])
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

        def loss_fn(mb: RolloutBatch, out: torch.Tensor):
            mask = mb.response_mask
            # out [b, r, 2]: the fused head's log p and entropy of positions p-1 .. s-2
            log_probs, entropy = out[..., 0], out[..., 1]
            old_log_probs = mb.old_log_probs
            if old_log_probs is None:  # the same values as compute_log_probs gives (0 past the response)
                old_log_probs = log_probs.detach() * response_keep(mb)
                index = rows_of[id(mb)]
                first.append((index, old_log_probs[None, : len(index)]))
            pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
                old_log_probs,
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
            head=_log_prob_head(ps, vocab, temperature, True, bool(cfg.entropy_coeff), chunk_tokens),
            rows_of=rows_of if first_forward else None,
        )
    metrics.update(router.metrics())
    if not cfg.entropy_coeff:  # as verl: the entropy is measured (actor/entropy), not a loss term
        metrics.pop("actor/entropy_loss", None)
    if first_forward:
        batch.old_log_probs = _assemble(first, batch, ps, 1)[0]
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
    # seq-mean-token-sum-norm divides by a constant (data.max_response_length), never a batch's own width
    width = cfg.loss_scale_factor or float(batch.response_length)

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
