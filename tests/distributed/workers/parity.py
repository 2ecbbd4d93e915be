"""Worker: Megatron logits vs HF logits for tiny random models at one TP x PP layout.

Writes {arch: {"max_diff", "max_logit", "bytes_read", "model_bytes"}} from the last pipeline stage
(TP rank 0) to --out. ``--corrupt qkv|fc1`` swaps in a wrong layout (the negative control).
"""

import argparse
import dataclasses
import json
import os

import torch

from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights
from megatron_rl.models.forward import gather_tp, run_pipeline
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.weights import tables
from megatron_rl.weights.tables import ParamLayout, Piece


def wrong_layout(lay: ParamLayout, kind: str, tp: int) -> ParamLayout:
    """The classic mistakes: qkv as [all q; all k; all v], fc1 as a plain chunk of [gate; up]."""
    if kind == "qkv" and "linear_qkv" in lay.name:
        full = sorted(
            {(p.hf_name, p.start, p.stop) for r in lay.pieces for p in r}, key=lambda x: (x[0], x[1])
        )
        order = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        full.sort(key=lambda x: (next(v for k, v in order.items() if k in x[0]), x[1]))
        flat = [Piece(*x) for x in full]
        per = len(flat) // tp
        return dataclasses.replace(lay, pieces=tuple(tuple(flat[r * per : (r + 1) * per]) for r in range(tp)))
    if kind == "fc1" and "linear_fc1" in lay.name:
        gate, up = lay.pieces[0][0].hf_name, lay.pieces[0][1].hf_name
        f = lay.shard_rows * tp // 2
        rows = [(gate, 0, f), (up, 0, f)]  # [gate; up] chunked along dim 0 as if it were one tensor
        pieces = []
        for r in range(tp):
            lo, hi = r * lay.shard_rows, (r + 1) * lay.shard_rows
            rank = []
            for i, (name, _, _) in enumerate(rows):
                a, b = max(lo, i * f), min(hi, (i + 1) * f)
                if a < b:
                    rank.append(Piece(name, a - i * f, b - i * f))
            pieces.append(tuple(rank))
        return dataclasses.replace(lay, pieces=tuple(pieces))
    return lay


@dataclasses.dataclass
class MB:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def megatron_logits(model, ps, vocab_size: int) -> tuple[list[MB], list[torch.Tensor]]:
    """Two fixed micro-batches of [2, 12] random tokens (one row left-padded) and the model's logits
    on them (gathered over TP, vocabulary padding cut; on the last stage)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 0, :4] = 0  # left padding in one sequence
    mbs = [MB(ids[i], mask[i]) for i in range(2)]
    with torch.no_grad():
        outs = run_pipeline(model, ps, mbs, lambda mb, out: gather_tp(out, ps)[..., :vocab_size], True)
    return mbs, outs


def hf_logit_diff(path: str, mbs: list[MB], outs: list[torch.Tensor]) -> tuple[float, float]:
    """(max |logit difference|, max |logit|) of the HF model at ``path`` on ``mbs`` against ``outs``,
    over real tokens: the oracle every parity worker compares with."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    diff, top = 0.0, 0.0
    with torch.no_grad():
        for mb, out in zip(mbs, outs, strict=True):
            ref = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            real = mb.attention_mask.bool()
            diff = max(diff, (ref - out)[real].abs().max().item())
            top = max(top, ref[real].abs().max().item())
    return diff, top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--corrupt", default=None)
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "unfused"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, device="cpu")
    orig = tables.param_layouts
    if a.corrupt:
        tables.param_layouts = lambda args, tp, role="actor": [
            wrong_layout(x, a.corrupt, tp) for x in orig(args, tp, role)
        ]
    try:
        check(a, ps)
    finally:
        tables.param_layouts = orig  # a later run in the same process (workers/runs.py) gets the real one
    destroy_parallel()


def check(a: argparse.Namespace, ps) -> None:
    results = {}
    for arch in a.archs:
        path = os.path.join(a.models, arch)
        args = load_model_args(path)
        model = build_model(args, ps, sdpa=a.attention == "sdpa")
        reader = load_hf_weights(model, path, ps)
        model.eval()
        mbs, outs = megatron_logits(model, ps, args.vocab_size)
        if ps.is_last_stage and ps.tp_rank == 0:
            diff, top = hf_logit_diff(path, mbs, outs)
            model_bytes = sum(
                os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")
            )
            results[arch] = {"max_diff": diff, "max_logit": top, "model_bytes": model_bytes}
        # every rank reports what it read
        read = torch.tensor([reader.bytes_read], dtype=torch.float64)
        allr = [torch.zeros_like(read) for _ in range(ps.world_size)]
        torch.distributed.all_gather(allr, read)
        if arch in results:
            results[arch]["bytes_read_per_rank"] = [int(x.item()) for x in allr]
    if results:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
