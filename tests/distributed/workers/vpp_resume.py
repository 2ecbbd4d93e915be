"""Worker: a model of interleaved pipeline chunks resumes bit for bit from the trainer's checkpoint
format (torch_dist weights + megatron's sharded optimizer state, run/checkpoint.py).

Two optimizer steps, save, two more steps (run A); a fresh model and optimizer load the save and take
the same two steps (run B); and a third that loads the weights only (Adam restarts: the negative
control). Writes {"resumed_equal", "weights_only_equal", "moved"} from rank 0 to --out.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.config import MegatronConfig, OptimConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights, named_global_params
from megatron_rl.models.forward import run_pipeline
from megatron_rl.optim import ModelOptimizer
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.run.checkpoint import load_optimizer, save_optimizer
from megatron_rl.weights.ckpt_write import save_torch_dist
from megatron_rl.weights.torch_dist import load_torch_dist
from tests.distributed.workers.parity import MB


def _fresh(args, path: str, ps, vpp: int):
    model = build_model(args, ps, options=TrainingOptions(virtual_pipeline=vpp))
    load_hf_weights(model, path, ps)
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.01, clip_grad=1.0)
    opt = ModelOptimizer(model, optim, MegatronConfig(use_distributed_optimizer=True), ps, total_steps=8)
    return model, opt


def _steps(model, opt, ps, vocab: int, first: int, n: int) -> None:
    """Optimizer steps ``first`` .. ``first + n - 1``, each over 4 micro-batches of its own tokens."""
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(100 + step)
        mbs = [MB(torch.randint(0, vocab, (2, 10), generator=g), torch.ones(2, 10)) for _ in range(4)]

        def loss_fn(mb, out):  # [b, s, V/TP] logits -> a mean over the mini-batch's 4 micro-batches
            return out.float().logsumexp(-1).mean() / 4, torch.tensor(1), {}

        opt.zero_grad()
        run_pipeline(opt.ddp, ps, mbs, loss_fn, forward_only=False)
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(named_global_params(model).items())])


def _all_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = torch.tensor([int(torch.equal(a, b))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=2)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(1, a.pp, device="cpu")
    args = load_model_args(a.model)
    model, opt = _fresh(args, a.model, ps, a.vpp)
    start = _flat(model)
    _steps(model, opt, ps, args.vocab_size, 0, 2)
    save_torch_dist(model, ps, os.path.join(a.ckpt, "actor"))
    save_optimizer(opt, ps, os.path.join(a.ckpt, "actor_optim"))
    counters = opt.counters()
    _steps(model, opt, ps, args.vocab_size, 2, 2)
    want = _flat(model)

    resumed, ropt = _fresh(args, a.model, ps, a.vpp)
    load_torch_dist(resumed, ps, os.path.join(a.ckpt, "actor"))
    load_optimizer(ropt, os.path.join(a.ckpt, "actor_optim"))
    ropt.load_counters(counters)
    _steps(resumed, ropt, ps, args.vocab_size, 2, 2)

    weights_only, wopt = _fresh(args, a.model, ps, a.vpp)
    load_torch_dist(weights_only, ps, os.path.join(a.ckpt, "actor"))
    wopt.load_counters(counters)
    _steps(weights_only, wopt, ps, args.vocab_size, 2, 2)

    result = {
        "resumed_equal": _all_equal(_flat(resumed), want),
        "weights_only_equal": _all_equal(_flat(weights_only), want),
        "moved": not _all_equal(start, want),
    }
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
