"""Worker: logits of mixture-of-experts models (Qwen3-MoE, Mixtral) at one TP x PP x EP layout vs HF.

Writes {arch: {"max_diff", "max_logit", "model_bytes", "bytes_read_per_rank", "experts_per_rank"}}
from the last pipeline stage (TP rank 0, EP rank 0) to --out. ``--corrupt swap_experts`` reads
experts 0 and 1 of every MoE layer into each other's place (the negative control).
"""

import argparse
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist

from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights, named_global_params
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.weights import tables
from megatron_rl.weights.tables import ParamLayout, Piece
from tests.distributed.workers.parity import hf_logit_diff, megatron_logits

_EXPERT = re.compile(r"\.experts\.([01])\.")


def swap_experts(lay: ParamLayout) -> ParamLayout:
    """Expert 0's parameters read expert 1's HF tensors and vice versa."""

    def other(name: str) -> str:
        return _EXPERT.sub(lambda m: f".experts.{1 - int(m.group(1))}.", name)

    pieces = tuple(tuple(Piece(other(p.hf_name), p.start, p.stop) for p in r) for r in lay.pieces)
    return dataclasses.replace(lay, pieces=pieces)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--corrupt", default=None, choices=[None, "swap_experts"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, device="cpu", ep=a.ep, etp=a.etp)
    if a.corrupt:
        orig = tables.param_layouts
        tables.param_layouts = lambda *args, **kw: [swap_experts(x) for x in orig(*args, **kw)]
    results = {}
    for arch in a.archs:
        path = os.path.join(a.models, arch)
        args = load_model_args(path)
        model = build_model(args, ps)
        reader = load_hf_weights(model, path, ps)
        model.eval()
        local = sorted(
            {
                int(m.group(1))
                for n in named_global_params(model)
                if (m := re.search(r"local_experts\.(\d+)", n))
            }
        )
        mbs, outs = megatron_logits(model, ps, args.vocab_size)
        if ps.is_last_stage and ps.tp_rank == 0 and ps.ep_rank == 0:
            diff, top = hf_logit_diff(path, mbs, outs)
            model_bytes = sum(
                os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")
            )
            results[arch] = {"max_diff": diff, "max_logit": top, "model_bytes": model_bytes}
        info = torch.tensor([reader.bytes_read, len(local), model.expert_offset], dtype=torch.float64)
        every = [torch.zeros_like(info) for _ in range(ps.world_size)]
        dist.all_gather(every, info)
        if arch in results:
            results[arch]["bytes_read_per_rank"] = [int(x[0]) for x in every]
            results[arch]["experts_per_rank"] = [int(x[1]) for x in every]
            results[arch]["first_expert_per_rank"] = [int(x[2]) for x in every]
    if results:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
