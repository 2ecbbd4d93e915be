"""Throughput, MFU and memory of a step (perf/*, timing_per_token_ms/*), under verl's names.

perf/total_num_tokens, perf/throughput      tokens of the step (all DP ranks), per second per GPU
timing_per_token_ms/<phase>                 gen per response token, the other phases per token
perf/mfu/actor, perf/mfu/critic             model FLOPs of the update (train_flops) / its seconds /
                                            the bf16 matmul peak measured at start (measure_peak_flops);
                                            an MoE model counts its active parameters (top-k experts +
                                            router), not all its experts
perf/optimizer_state_gb                     fp32 main weights + Adam moments on this rank
perf/max_memory_*_gb                        torch's and the device's peaks (the engine allocates
                                            outside torch's caching allocator)
actor/perf/*_gb, critic/perf/*_gb           the same peaks under verl's per-role names
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_rl.batch import RolloutBatch
    from megatron_rl.config import Config
    from megatron_rl.parallel import ParallelState
    from megatron_rl.run.metrics import Timer


def perf_metrics(
    cfg: Config,
    ps: ParallelState,
    actor_args,
    critic_args,
    optimizers: Sequence[Any],
    batch: RolloutBatch,
    metrics: dict[str, float],
    peak_flops: float | None,
    timer: Timer,
    job_size: int | None = None,
) -> dict[str, float]:
    """perf/* and timing_per_token_ms/* of a step whose ``metrics`` hold its timing_s/* (module docstring);
    throughput is per GPU of the whole job (``job_size``: the rollout's own ranks count too).
    ``critic_args``: the critic's model args when it trains on these ranks, else None; ``optimizers``:
    those held on this rank (their state's size is reported)."""
    seq_lens = batch.attention_mask.sum(-1).double()
    # generated tokens from the attention mask: rollout rejection may have taken some off the response
    # mask, but they were generated and went through every forward all the same
    responses = batch.attention_mask[:, batch.prompts.shape[1] :].sum().double()
    sums = torch.stack([seq_lens.sum(), responses, seq_lens.square().sum()])
    dist.all_reduce(sums, group=ps.dp_group)
    total, responses, squares = sums.tolist()
    out = {
        "perf/total_num_tokens": total,
        "perf/throughput": total / max(metrics["timing_s/step"], 1e-9) / (job_size or ps.world_size),
    }
    # verl's per-token times: generation per response token, the other phases per token processed
    for phase in ("gen", "ref", "values", "adv", "update_critic", "update_actor"):
        if f"timing_s/{phase}" in metrics:
            per = responses if phase == "gen" else total
            out[f"timing_per_token_ms/{phase}"] = metrics[f"timing_s/{phase}"] * 1000 / max(per, 1.0)
    actor_epochs = cfg.actor_rollout_ref.actor.ppo_epochs
    trained = [("actor", actor_args, actor_epochs, True)]
    if critic_args is not None:  # the critic trains on these ranks (unset, its epochs are the actor's)
        trained.append(("critic", critic_args, cfg.critic.ppo_epochs or actor_epochs, False))
    for role, args, epochs, lm_head in trained:
        upd = metrics.get(f"timing_s/update_{role}")
        if upd and peak_flops:
            flops = train_flops(args, total, responses, squares, lm_head)
            flops *= epochs / ps.world_size  # per GPU
            out[f"perf/mfu/{role}"] = flops / upd / peak_flops
    # fp32 main weights and Adam's moments held on this rank (sharded over DP by the distributed
    # optimizer), wherever they are parked
    out["perf/optimizer_state_gb"] = sum(o.state_bytes() for o in optimizers) / 2**30
    if ps.device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(ps.device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(ps.device) / 2**30
        # The engine allocates outside torch's caching allocator: device-level use is the true peak.
        out["perf/max_device_memory_used_gb"] = timer.max_device_used / 2**30
        if peak_flops is not None:  # measured on every GPU (measure_peak_flops)
            out["perf/peak_tflops"] = peak_flops / 1e12
    else:
        import resource

        out["perf/max_memory_allocated_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    # verl logs each worker's memory under its role: the roles share these processes, so the same peaks
    for role in [r for r, *_ in trained]:
        for name in ("max_memory_allocated_gb", "max_memory_reserved_gb"):
            if f"perf/{name}" in out:
                out[f"{role}/perf/{name}"] = out[f"perf/{name}"]
    return out


def train_flops(
    args, tokens: float, response_tokens: float, sum_sq_lens: float, lm_head: bool = True
) -> float:
    """Model FLOPs of one forward + backward over a batch: 6 per weight per token for the transformer
    body, the LM head on response tokens only (the only positions it runs on; the critic's scalar head
    is negligible), and causal attention scores (QK^T and AV over n^2 / 2 pairs per sequence of n
    tokens, times 3 for the backward).

    A mixture-of-experts body counts its active parameters (``ModelArgs.num_active_params``): each
    token passes through its top-k experts and the router of every MoE layer, not all the experts,
    so MFU compares the FLOPs actually done with the peak."""
    head = args.vocab_size * args.hidden_size  # the embedding lookup itself costs no FLOPs
    body = args.num_active_params() - head * (1 if args.tie_embeddings else 2)
    attention = 6 * args.num_layers * args.num_heads * args.attention_head_dim * sum_sq_lens
    return 6 * body * tokens + (6 * head * response_tokens if lm_head else 0) + attention


def measure_peak_flops(device: torch.device) -> float | None:
    """bf16 matmul throughput of this GPU (the MFU denominator); None on CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    iters = 20
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)
