"""Worker: one PPO update of a mixture-of-experts actor (router aux loss and z-loss on) at one
TP x EP x DP layout, from the same HF weights and the same global rollout batch at every layout.

Each DP rank takes its rows of every mini-batch (ppo_update.dp_rows), so the global mini-batches and
micro-batches are the same sequences at every layout. Every rank writes rank{R}.pt: its parameters
as whole HF tensors before and after the update (TP shards gathered), its raw parameters after it
(a key held by several ranks is a copy of one tensor: same name, same TP shard) and the metrics.
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_rl.config import ActorConfig, MegatronConfig, OptimConfig
from megatron_rl.config.load import fill_update_defaults
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import (
    TrainingOptions,
    build_model,
    load_hf_weights,
    named_global_params,
    stage_layouts,
)
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.ppo import compute_log_probs, update_actor
from megatron_rl.weights.hf_io import hf_names, scatter_shard
from megatron_rl.weights.tables import hf_shapes
from tests.distributed.workers.ppo_update import MINI_PROMPTS, ROLLOUT_N, TEMPERATURE, dp_rows, global_batch


def _copy_key(name: str, p: torch.Tensor, ps) -> str:
    """A TP shard is named with its shard index: equal keys on two ranks are copies of one tensor."""
    return f"{name}@tp{ps.tp_rank}" if getattr(p, "tensor_model_parallel", False) else name


def hf_tensors(model, ps) -> dict[str, torch.Tensor]:
    """This rank's parameters as whole HF tensors (TP shards gathered; its own experts only)."""
    params = named_global_params(model)
    shapes = hf_shapes(model.args)
    out: dict[str, torch.Tensor] = {}
    for lay in stage_layouts(model, ps):
        shard = params[lay.name].detach()
        n = ps.tp_size if lay.expert is None else ps.etp_size  # expert TP group = TP group here
        shards = [torch.empty_like(shard) for _ in range(n)]
        if n > 1:
            dist.all_gather(shards, shard.contiguous(), group=ps.tp_group)
        else:
            shards = [shard]
        for name in hf_names(lay):
            out.setdefault(name, torch.zeros(shapes[name]))
        for r, sh in enumerate(shards):
            scatter_shard(lay, r, sh, out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--aux", type=float, default=0.01, help="moe_aux_loss_coeff (moe_z_loss_coeff: a tenth)")
    ap.add_argument("--sequential-experts", action="store_true", help="SequentialMLP, not GroupedExperts")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, 1, seed=1, device="cpu", ep=a.ep)
    args = load_model_args(a.model)
    full, extra = global_batch(args.vocab_size)
    rows = dp_rows(ps.dp_rank, ps.dp_size)
    batch = full.select(rows)
    ex = {k: v[rows] for k, v in extra.items()}
    # megatron trains MoE layers at TP > 1 only with sequence parallelism
    options = TrainingOptions(
        sequence_parallel=a.tp > 1,
        moe_aux_loss_coeff=a.aux,
        moe_z_loss_coeff=a.aux / 10,
        moe_grouped_gemm=not a.sequential_experts,
    )
    model = build_model(args, ps, "actor", options=options)
    load_hf_weights(model, a.model, ps)
    initial = hf_tensors(model, ps)
    micro = 2  # per GPU: the same micro-batches (sets of sequences) at DP1 and DP2
    lp = compute_log_probs(model, ps, batch, micro, TEMPERATURE)
    mask = batch.response_mask
    batch.old_log_probs = (lp + ex["old_noise"]) * mask
    batch.advantages = ex["advantages"]
    cfg = ActorConfig(
        ppo_mini_batch_size=MINI_PROMPTS,
        ppo_micro_batch_size_per_gpu=micro,
        ppo_epochs=1,
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=float(batch.response_length),  # a constant: the batch's response width
        optim=OptimConfig(lr=2e-3, lr_warmup_steps=0, weight_decay=0.0, clip_grad=1.0, eps=1e-6),
    )
    fill_update_defaults(cfg, batch.response_length)
    opt = ModelOptimizer(model, cfg.optim, MegatronConfig(use_distributed_optimizer=True), ps, total_steps=2)
    metrics = update_actor(model, opt, ps, batch, cfg, ROLLOUT_N, TEMPERATURE)
    weights = {_copy_key(n, p, ps): p.detach().clone() for n, p in named_global_params(model).items()}
    hf = hf_tensors(model, ps)
    torch.save(
        {"metrics": metrics, "weights": weights, "initial": initial, "hf": hf},
        os.path.join(a.out, f"rank{ps.rank}.pt"),
    )
    destroy_parallel()


if __name__ == "__main__":
    main()
