"""Worker: bf16 training with stochastic rounding keeps every replica of a parameter bit-identical.

A 1-layer Llama (O(1) random weights) in bf16 on every rank; each data-parallel rank feeds its own
token batch (the gradients differ until DDP reduces them), then 4 optimizer steps at an RL-sized LR
through megatron's DDP and optimizer (plain or distributed), with stochastic rounding of the fp32 main
weights into the bf16 parameters. Rank 0 writes --out (JSON):

- ``dp_diff_elements``: elements that differ between the DP ranks' copies of the parameters;
- ``tp_diff_elements``: elements that differ between the TP ranks' copies of TP-replicated
  parameters (norm weights);
- ``update_frac``: the share of bf16 elements the steps changed (the rounding did move them).

Variants (one model each, in one launch): the distributed optimizer, the plain one, and the plain one
with each rank's rounding noise seeded differently (the negative control: replicas then drift apart,
which the counts must show).
"""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_rl import cpu_bridge
from megatron_rl.config import MegatronConfig, OptimConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights
from megatron_rl.models.forward import causal_padding_mask
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import destroy_parallel, init_parallel


def diff_elements(p: torch.Tensor, group) -> int:
    """Elements of ``p`` that differ from the first rank's copy in ``group``."""
    copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, p.detach().contiguous(), group=group)
    return int(sum((c != copies[0]).sum().item() for c in copies))


VARIANTS = {  # name: (distributed optimizer, per-rank noise seed, learning rate)
    "distributed": (True, False, 1e-5),
    "plain": (False, False, 1e-5),
    # The negative control, at a rate whose steps are a sizeable share of a bf16 ulp: at 1e-5 the few
    # TP-replicated norm elements round up about once in the whole run, so two noise streams often
    # leave them alike and the control would prove nothing.
    "plain_rank_seed": (False, True, 1e-3),
}


def train(a: argparse.Namespace, ps, distributed: bool, rank_seed: bool, lr: float) -> dict:
    args = load_model_args(a.model)
    model = build_model(args, ps, "actor", dtype=torch.bfloat16)
    load_hf_weights(model, a.model, ps)
    mcfg = MegatronConfig(use_distributed_optimizer=distributed)
    ocfg = OptimConfig(lr=lr, lr_warmup_steps=0, weight_decay=0.0, stochastic_rounding=not a.nearest)
    opt = ModelOptimizer(model, ocfg, mcfg, ps, total_steps=4, seed=7 + (ps.rank if rank_seed else 0))
    g = torch.Generator().manual_seed(100 + ps.dp_rank)  # each DP rank its own data
    for _ in range(4):
        ids = torch.randint(3, args.vocab_size, (2, 6), generator=g)
        opt.zero_grad()
        with cpu_bridge.device_mode():
            out = opt.ddp(ids, None, causal_padding_mask(torch.ones_like(ids)))
        # [2, 6, V/TP] logits -> next-token cross entropy over the whole vocabulary (the same loss
        # on every TP rank, so TP-replicated weights get the same gradient everywhere)
        loss = tensor_parallel.vocab_parallel_cross_entropy(out[:, :-1].float().contiguous(), ids[:, 1:])
        loss.mean().backward()
        with cpu_bridge.device_mode():
            opt.ddp.finish_grad_sync()  # DP all-reduce (the schedule's finalize step does it in training)
        norm, _ = opt.step()
        assert torch.isfinite(torch.tensor(norm)), norm
    params = list(model.parameters())
    replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]
    return {
        "dp_diff_elements": sum(diff_elements(p, ps.dp_group) for p in params) if ps.dp_size > 1 else 0,
        "tp_diff_elements": sum(diff_elements(p, ps.tp_group) for p in replicated) if ps.tp_size > 1 else 0,
        "update_frac": opt.pop_update_fraction(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--nearest", action="store_true", help="round to nearest instead")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    ps = init_parallel(a.tp, 1, seed=0, device="cpu")
    res = {name: train(a, ps, *VARIANTS[name]) for name in a.variants}
    res["dp_size"], res["tp_size"] = ps.dp_size, ps.tp_size
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
