"""Log-probs and entropy of sampled tokens under a vocab-parallel LM head, without gathering the vocabulary.

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

:func:`fused_log_probs_and_entropy` is what the training passes use: it takes the final hidden states
[n, h] and the head's weight shard [V_pad/TP, h] instead of logits, computes the logits chunk by chunk
(``chunk_tokens`` rows at a time), keeps per-token statistics only, reduces them across TP once for
the whole pass, and recomputes each chunk's logits in the backward. No [n, V/TP] tensor is ever held
for all n tokens (docs/performance.md has the memory it saves).
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


# --------------------------------------------------------------------------------------------------
# The LM head fused with the log-probs: no [tokens, V/TP] logits tensor for the whole pass
# --------------------------------------------------------------------------------------------------

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk of the fused head: the largest temporaries are a few [chunk, V/TP] fp32 tensors
(1024 x 151936 x 4 B = 0.6 GB at TP=1)."""


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, temperature: float, n_valid: int) -> torch.Tensor:
    """[c, h] @ [V/TP, h]^T in the model's dtype -> fp32 logits / temperature [c, V/TP], padded rows -inf."""
    z = torch.nn.functional.linear(x, weight).float()
    if temperature != 1.0:
        z.div_(temperature)
    if n_valid < z.shape[-1]:
        z[:, n_valid:] = float("-inf")
    return z


class _FusedHeadLogProbs(torch.autograd.Function):
    """hidden [n, h], weight [V/TP, h] -> log p(targets) [n], entropy [n]; see the section above.

    Forward, per chunk of c tokens, local to the rank: m_r = max_v z, S_r = sum_v exp(z - m_r),
    E_r = sum_v exp(z - m_r)(z - m_r), z_t (0 unless this shard owns the target). Across TP, once for
    the whole pass: M = max_r m_r (all-reduce MAX), then SUM of [S_r e^(m_r - M), z_t,
    e^(m_r - M)(E_r + (m_r - M) S_r)] -> S, z_t, E with the shift M; log p_t = (z_t - M) - log S,
    H = log S - E / S. Backward recomputes each chunk's logits from (hidden, weight) and lse = M + log S.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, vocab_size, temperature, tp_group, opts):
        with_entropy, entropy_grad, chunk = opts
        n, local_v = hidden.shape[0], weight.shape[0]
        n_valid = max(0, min(local_v, vocab_size - vocab_start))  # real (unpadded) rows of this shard
        t_local = targets - vocab_start
        in_shard = (t_local >= 0) & (t_local < n_valid)  # [n]: this rank owns the target row
        t_index = torch.where(in_shard, t_local, torch.zeros_like(t_local))
        f32 = dict(dtype=torch.float32, device=hidden.device)
        m, s, e, z_t = (torch.zeros(n, **f32) for _ in range(4))
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            z = _chunk_logits(hidden[lo:hi], weight, temperature, n_valid)  # [c, V/TP]
            z_t[lo:hi] = torch.where(in_shard[lo:hi], z.gather(-1, t_index[lo:hi, None])[:, 0], 0.0)
            z_max = z.max(dim=-1).values  # -inf only where the whole shard is padding
            m[lo:hi] = z_max
            z.sub_(z_max[:, None])
            if with_entropy:
                p = z.exp()  # padded rows: exp(-inf) = 0
                if n_valid < local_v:
                    z[:, n_valid:] = 0.0  # so that p * z is 0 there, not 0 * -inf
                s[lo:hi] = p.sum(dim=-1)
                e[lo:hi] = torch.einsum("cv,cv->c", p, z)  # sum_v p (z - m), no [c, V/TP] temporary
                del p
            else:
                s[lo:hi] = z.exp_().sum(dim=-1)
            del z
        if n_valid == 0:  # a shard of padding only: no mass, and no NaN from -inf - -inf
            m.fill_(float("-inf"))
            s.zero_()
            e.zero_()
        if tp_group is not None:
            shift = m.clone()
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
            has_mass = s > 0
            scale = torch.where(has_mass, (m - shift).exp(), 0.0)
            e = torch.where(has_mass, (e + (m - shift) * s) * scale, 0.0)
            stats = torch.stack([s * scale, z_t, e])  # [3, n]: one all-reduce for the three sums
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
            s, z_t, e, m = stats[0], stats[1], stats[2], shift
        log_s = s.log()
        log_probs = (z_t - m) - log_s
        entropy = log_s - e / s if with_entropy else torch.zeros_like(log_probs)
        ctx.save_for_backward(hidden, weight, t_index, in_shard, m + log_s, entropy)
        ctx.set_materialize_grads(False)  # an output outside the loss (entropy as a metric) costs nothing
        ctx.args = (temperature, n_valid, chunk, tp_group, with_entropy and entropy_grad)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, t_index, in_shard, lse, entropy = ctx.saved_tensors
        temperature, n_valid, chunk, tp_group, entropy_grad = ctx.args
        if not entropy_grad:
            grad_entropy = None
        none = (None,) * 6
        if grad_log_probs is None and grad_entropy is None:
            return None, None, *none
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # fp32 accumulator over the chunks, cast once at the end
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            log_p = _chunk_logits(hidden[lo:hi], weight, temperature, n_valid).sub_(lse[lo:hi, None])
            p = log_p.exp()  # softmax shard [c, V/TP]; padded rows 0
            if grad_log_probs is not None:  # d log p_t / dz = onehot(t) - p
                g_lp = grad_log_probs[lo:hi]
                grad = p * -g_lp[:, None]
                grad.scatter_add_(-1, t_index[lo:hi, None], (g_lp * in_shard[lo:hi])[:, None])
            else:
                grad = torch.zeros_like(p)
            if grad_entropy is not None:  # dH/dz = -p (log p + H)
                if n_valid < log_p.shape[-1]:
                    log_p[:, n_valid:] = 0.0  # p = 0 there: no 0 * -inf
                log_p.add_(entropy[lo:hi, None]).mul_(p)
                grad.addcmul_(log_p, grad_entropy[lo:hi, None], value=-1.0)
            del log_p, p
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(weight.dtype)  # [c, V/TP]
            if grad_hidden is not None:
                torch.matmul(grad, weight, out=grad_hidden[lo:hi])
            if grad_weight is not None:
                grad_weight.add_(grad.t().matmul(hidden[lo:hi]))
            del grad
        if grad_hidden is not None and tp_group is not None:  # each shard gave its rows' share
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, *none


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ps: Any,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of ``targets`` from the final hidden states, the LM head fused in.

    Equal to ``vocab_parallel_log_probs_and_entropy(hidden @ weight^T, ...)`` up to float rounding, and
    differentiable with respect to ``hidden`` and ``weight``, but the logits exist only for
    ``chunk_tokens`` tokens at a time, in the forward and again (recomputed) in the backward.

    Args:
        hidden: [..., h] final hidden states (after the final norm) of the positions that predict
            ``targets``; the same on every TP rank.
        weight: [V_pad/TP, h] this TP rank's shard of the output layer (or the tied embedding).
        targets: [...] global token ids in [0, vocab_size).
        ps: the :class:`~megatron_rl.parallel.ParallelState` (``tp_size``, ``tp_rank``, ``tp_group``).
        vocab_size: the real vocabulary size; rows at or beyond it are padding and excluded.
        temperature: the logits are divided by it first (the rollout's sampling temperature).
        with_entropy: also return the entropy of the full (unpadded) distribution.
        entropy_grad: the entropy is part of the loss (False: a metric only, no gradient, cheaper).
        chunk_tokens: tokens per chunk (memory O(chunk_tokens x V/TP)).

    Returns:
        log_probs [...] float32, and entropy [...] float32 when ``with_entropy``; the same on every TP
        rank. The gradient of ``hidden`` is summed over the TP group (the column-parallel head's
        all-reduce), the gradient of ``weight`` is this rank's shard.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature} (rollout.temperature)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
            f"{tuple(targets.shape)} do not match"
        )
    local_v = weight.shape[0]
    if local_v * ps.tp_size < vocab_size:
        raise ValueError(
            f"weight covers {local_v} x TP {ps.tp_size} rows, fewer than vocab_size={vocab_size}"
        )
    group = ps.tp_group if ps.tp_size > 1 else None
    shape = targets.shape
    log_probs, entropy = _FusedHeadLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        ps.tp_rank * local_v,
        vocab_size,
        float(temperature),
        group,
        (with_entropy, entropy_grad, int(chunk_tokens)),
    )
    log_probs, entropy = log_probs.view(shape), entropy.view(shape)
    return (log_probs, entropy) if with_entropy else log_probs
