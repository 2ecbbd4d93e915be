"""Log-probs and entropy of sampled tokens from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism the LM head is column-parallel: TP rank r holds logits for the vocabulary rows
[r * V_pad/TP, (r + 1) * V_pad/TP). The softmax statistics are reduced across the TP group instead of
gathering [b, s, V] on one rank:

    z        = logits / temperature, padded rows (global index >= vocab_size) set to -inf     [b, s, V/TP]
    m        = max_v z          (all-reduce MAX)                                             [b, s]
    S        = sum_v exp(z - m) (all-reduce SUM)      lse = m + log S                          [b, s]
    z_t      = z[target]        (SUM: only the rank that owns the target contributes)        [b, s]
    log p_t  = z_t - lse
    entropy  = lse - sum_v p_v z_v                    (sum_v exp(z - m) (z - m): SUM)        [b, s]

The three sums travel in one all-reduce. The backward is analytic and local to each rank (no
communication): every TP rank computes the same loss from the same reduced statistics, so the gradient
with respect to its own logit shard is

    d log p_t / d z_v = 1[v == t] - p_v           d H / d z_v = -p_v (log p_v + H)

divided by the temperature; padded rows have p_v = 0 and get a zero gradient. The model's
column-parallel output layer then all-reduces the gradient of its input across TP, as for any loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, temperature, tp_group, with_entropy):
        local_v = logits.shape[-1]
        # fp32 working copy [b, s, V/TP] (never modify the caller's logits); it becomes z - m, then exp.
        z = logits.to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)
        n_valid = max(0, min(local_v, vocab_size - vocab_start))  # real (unpadded) rows of this shard
        if n_valid < local_v:
            z[..., n_valid:] = float("-inf")
        z_max = z.max(dim=-1).values  # [b, s]; -inf only if this whole shard is padding
        if tp_group is not None:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
        z.sub_(z_max.unsqueeze(-1))

        t_local = targets - vocab_start
        in_shard = (t_local >= 0) & (t_local < n_valid)  # [b, s]: this rank owns the target row
        t_index = torch.where(in_shard, t_local, torch.zeros_like(t_local))
        z_target = torch.where(in_shard, z.gather(-1, t_index.unsqueeze(-1)).squeeze(-1), 0.0)

        if with_entropy:
            exp = z.exp()  # padded rows: exp(-inf) = 0
            if n_valid < local_v:
                z[..., n_valid:] = 0.0  # so that exp * z is 0 there, not 0 * -inf
            # sum_v exp(z_v - m) (z_v - m) as a batched dot product (no [b, s, V/TP] temporary)
            stats = [exp.sum(dim=-1), z_target, torch.einsum("...v,...v->...", exp, z)]
            del z
        else:
            exp = z.exp_()
            stats = [exp.sum(dim=-1), z_target]
        stats = torch.stack(stats)  # [2 or 3, b, s]
        if tp_group is not None:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
        log_sum = stats[0].log()  # lse - m
        log_probs = stats[1] - log_sum
        probs = exp.div_(stats[0].unsqueeze(-1))  # softmax shard [b, s, V/TP], in exp's memory
        if with_entropy:
            entropy = log_sum - stats[2] / stats[0]
        else:
            entropy = torch.zeros_like(log_probs)
        ctx.save_for_backward(probs, t_index, in_shard, entropy)
        ctx.set_materialize_grads(False)  # an output outside the loss (entropy as a metric) costs nothing
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.logits_dtype = logits.dtype
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, t_index, in_shard, entropy = ctx.saved_tensors
        if grad_log_probs is not None:  # d log p_t / dz = onehot(t) - p
            grad = probs * -grad_log_probs.unsqueeze(-1)
            grad.scatter_add_(-1, t_index.unsqueeze(-1), (grad_log_probs * in_shard).unsqueeze(-1))
        else:
            grad = torch.zeros_like(probs)
        if ctx.with_entropy and grad_entropy is not None:
            # dH/dz = -(p log p + p H); xlogy gives 0 (not NaN) on padded rows where p = 0.
            dh = torch.special.xlogy(probs, probs).addcmul_(probs, entropy.unsqueeze(-1))
            grad.addcmul_(dh, grad_entropy.unsqueeze(-1), value=-1.0)
            del dh
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ps: Any,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of ``targets`` under vocab-parallel ``logits``, differentiable.

    Args:
        logits: [b, s, V_pad/TP] this TP rank's vocabulary shard (any float dtype; computed in fp32).
        targets: [b, s] global token ids in [0, vocab_size).
        ps: the :class:`~megatron_rl.parallel.ParallelState` (only ``tp_size``, ``tp_rank`` and
            ``tp_group`` are used; at TP=1 no collective is issued).
        vocab_size: the real vocabulary size; rows at or beyond it are padding and excluded.
        temperature: the logits are divided by it first (the rollout's sampling temperature).
        with_entropy: also return the entropy of the full (unpadded) distribution.

    Returns:
        log_probs [b, s] float32, and entropy [b, s] float32 when ``with_entropy``. Every TP rank
        returns the same values and receives the correct gradient for its own shard.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature} (rollout.temperature)")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    local_v = logits.shape[-1]
    if local_v * ps.tp_size < vocab_size:
        raise ValueError(f"logits cover {local_v} x TP {ps.tp_size} rows, fewer than vocab_size={vocab_size}")
    group = ps.tp_group if ps.tp_size > 1 else None
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets.long(), ps.tp_rank * local_v, vocab_size, float(temperature), group, with_entropy
    )
    return (log_probs, entropy) if with_entropy else log_probs
