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

One update (:func:`update_actor` / :func:`update_critic`) is ppo_loop.py's loop, the same for both
roles: epochs x mini-batches (one optimizer step each) x micro-batches, where each micro-batch's loss
is an additive share of the mini-batch mean over all DP ranks (the aggregation divides by the whole
mini-batch's count); the roles give it their loss:

    actor loss  = pg_loss(old_log_probs, log_probs, advantages; clip low/high, dual-clip c)
                  - entropy_coeff * entropy + kl_loss_coef * KL(log_probs, ref_log_probs)
    critic loss = 0.5 * max((v - R)^2, (clip(v, V_old +- cliprange_value) - R)^2)

Metrics are mini-batch values averaged over mini-batches and epochs, the same dict on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch
from torch import nn

from megatron_rl import seeds
from megatron_rl.algos import (
    PolicyLossOptions,
    compute_policy_loss,
    compute_value_loss,
    effective_agg_mode,
    kl_penalty,
    masked_mean,
)
from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ActorConfig, CriticConfig
from megatron_rl.microbatches import MicroBatching, TokenStats, response_keep
from megatron_rl.model_args import ModelArgs
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
from megatron_rl.ppo_loop import Head, MiniBatch, RoleLoss, UpdatePlan, run_update, split

# --------------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------------


def _response_positions(mb: RolloutBatch) -> Positions:
    return mb.response_positions


def _vocab_size(model: nn.Module) -> int:
    """The real vocabulary of a model built by models/builder.py (which keeps its ModelArgs on it)."""
    args = model.args
    assert isinstance(args, ModelArgs), type(args)
    return args.vocab_size


def _log_prob_head(
    ps: ParallelState, vocab: int, temperature: float, with_entropy: bool, entropy_grad: bool, chunk: int
) -> Head:
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
        return torch.stack(out, dim=-1) if isinstance(out, tuple) else out[..., None]

    return head


def _micro(micro: int | MicroBatching) -> MicroBatching:
    return micro if isinstance(micro, MicroBatching) else MicroBatching(size=micro)


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
    head: Head | None = None,
) -> torch.Tensor:
    """Run ``batch`` through the pipeline (``head``: see run_pipeline); ``per_micro_batch(mb, output)
    -> [rows, b, r]`` on the last stage (r: the micro-batch's response width); returns [rows, B, R]
    float32 on every rank, 0 past each sequence's last response token (whatever the micro-batching)."""
    mbs, groups = split(model, ps, batch, _micro(micro), stats)
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
    head = _log_prob_head(ps, _vocab_size(model), temperature, with_entropy, False, chunk_tokens)

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
# The updates: each role's loss, through the one loop of ppo_loop.py
# --------------------------------------------------------------------------------------------------


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
    Returns actor/loss, pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, entropy, [kl_loss],
    [entropy_loss: the entropy again, when entropy_coeff makes it a loss term, as verl], then
    :func:`~megatron_rl.ppo_loop.run_update`'s grad_norm, lr, nonfinite_grad_steps, and the MoE
    router metrics.
    """
    key = "actor_rollout_ref.actor"
    needs = ("advantages",) + (("ref_log_probs",) if cfg.use_kl_loss else ())
    plan = UpdatePlan.of(batch, cfg, rollout_n, ps.dp_size, key, "update_actor", needs)
    first_forward = batch.old_log_probs is None
    if first_forward and (plan.epochs != 1 or plan.rows != len(batch)):
        raise ValueError(
            f"update_actor: batch.old_log_probs is not set, but {key}.ppo_epochs={cfg.ppo_epochs} and "
            f"{len(batch) // plan.rows} mini-batches ({key}.ppo_mini_batch_size) need them: compute them "
            f"before the update (only ppo_epochs=1 with one mini-batch per step may skip that pass)."
        )
    first: list[tuple[torch.Tensor, torch.Tensor]] = []  # (batch rows, their detached log-probs [1, n, r])
    names: tuple[str, ...] = ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy")
    if cfg.use_kl_loss:
        names += ("kl_loss",)
    spec = plan.spec  # clip bounds, aggregation and loss scale: config.specs.UpdateSpec
    loss_mode = cfg.policy_loss.loss_mode
    pg_agg_mode = effective_agg_mode(loss_mode, spec.loss_agg_mode)
    options = PolicyLossOptions(
        clip_cov_ratio=cfg.policy_loss.clip_cov_ratio,
        clip_cov_lb=cfg.policy_loss.clip_cov_lb,
        clip_cov_ub=cfg.policy_loss.clip_cov_ub,
        kl_cov_ratio=cfg.policy_loss.kl_cov_ratio,
        ppo_kl_coef=cfg.policy_loss.ppo_kl_coef,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
    )
    # clip_cov picks tokens at random: the TP/PP peers of one replica draw the same (same seed, same data).
    generator = torch.Generator().manual_seed(seeds.derive(seeds.CLIP_COV, shuffle_seed, ps.dp_rank))

    def loss(mb: RolloutBatch, out: torch.Tensor, mini: MiniBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        mask, advantages = mb.response_mask, _needed(mb.advantages)
        # out [b, r, 2]: the fused head's log p and entropy of positions p-1 .. s-2
        log_probs, entropy = out[..., 0], out[..., 1]
        old_log_probs = mb.old_log_probs
        if old_log_probs is None:  # the same values as compute_log_probs gives (0 past the response)
            old_log_probs = log_probs.detach() * response_keep(mb)
            index = mini.rows_of[id(mb)]
            first.append((index, old_log_probs[None, : len(index)]))
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
            old_log_probs,
            log_probs,
            advantages,
            mask,
            clip_ratio=cfg.clip_ratio,
            clip_ratio_low=spec.clip_low,
            clip_ratio_high=spec.clip_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=spec.loss_agg_mode,
            global_denominator=mini.denominator(pg_agg_mode),
            loss_mode=loss_mode,
            options=options,
            rollout_is_weights=mb.rollout_is_weights,
            loss_scale_factor=spec.loss_scale,
            generator=generator,
        )
        ent = mini.agg(entropy, mask)
        total = pg_loss - cfg.entropy_coeff * ent if cfg.entropy_coeff else pg_loss
        # Diagnostics are token means over the mini-batch: local mean x local tokens / global tokens.
        weight = mini.token_share(mask)
        metrics = [
            pg_loss.detach(),
            clipfrac * weight,
            clipfrac_lower * weight,
            ppo_kl * weight,
            ent.detach(),
        ]
        if cfg.use_kl_loss:
            kl_loss = mini.agg(kl_penalty(log_probs, _needed(mb.ref_log_probs), cfg.kl_loss_type), mask)
            total = total + cfg.kl_loss_coef * kl_loss
            metrics.append(kl_loss.detach())
        return total, [total.detach(), *metrics]

    head = _log_prob_head(ps, _vocab_size(model), temperature, True, bool(cfg.entropy_coeff), chunk_tokens)
    # as verl: without the bonus the entropy is measured (actor/entropy), not a loss term
    aliases = {"entropy_loss": "entropy"} if cfg.entropy_coeff else {}
    role = RoleLoss("actor", names, loss, aliases, _response_positions, head)
    with RouterStats(model, ps, "actor") as router:  # MoE: aux/z-loss and expert load; dense: nothing
        metrics = run_update(model, optimizer, ps, batch, plan, role, shuffle_seed, stats)
    metrics.update(router.metrics())
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

    Returns critic/vf_loss, vf_clipfrac, vpred_mean, loss (verl's other name of vf_loss), then
    :func:`~megatron_rl.ppo_loop.run_update`'s grad_norm, lr, nonfinite_grad_steps.
    """
    plan = UpdatePlan.of(batch, cfg, rollout_n, ps.dp_size, "critic", "update_critic", ("values", "returns"))

    def loss(mb: RolloutBatch, out: torch.Tensor, mini: MiniBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        mask = mb.response_mask
        vpreds = select_positions(out[..., 0], mb.response_positions, seq_first=False).float()  # [b, r]
        vf_loss, clipfrac = compute_value_loss(
            vpreds,
            values=_needed(mb.values),
            returns=_needed(mb.returns),
            response_mask=mask,
            cliprange_value=plan.spec.clip_high,
            loss_agg_mode=plan.spec.loss_agg_mode,
            global_denominator=mini.denominator(),
            loss_scale_factor=plan.spec.loss_scale,
        )
        weight = mini.token_share(mask)
        return vf_loss, [vf_loss.detach(), clipfrac * weight, masked_mean(vpreds.detach(), mask) * weight]

    role = RoleLoss("critic", ("vf_loss", "vf_clipfrac", "vpred_mean"), loss, {"loss": "vf_loss"})
    return run_update(critic, optimizer, ps, batch, plan, role, shuffle_seed, stats)


def _needed(field: torch.Tensor | None) -> torch.Tensor:
    """A micro-batch field that :meth:`UpdatePlan.of <megatron_rl.ppo_loop.UpdatePlan.of>` found set
    on the batch (micro-batches carry the batch's fields)."""
    assert field is not None
    return field
