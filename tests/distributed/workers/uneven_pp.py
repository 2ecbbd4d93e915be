"""Worker: logits of models split unevenly over pipeline stages (megatron's
num_layers_in_first/last_pipeline_stage) vs the HF model, and a torch_dist checkpoint saved at that
split.

Writes {arch: {"max_diff", "max_logit", "stage_layers", "layer_offset_per_rank"}} from the last stage
to --out. ``--corrupt duplicate`` reads the last layer from the HF layer before it (that layer twice, its
own never: the negative control). ``--save DIR`` saves each model's torch_dist
checkpoint (megatron's sharded state dict) under DIR/<arch>.
"""

import argparse
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist

from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.weights import tables
from megatron_rl.weights.tables import ParamLayout, Piece
from tests.distributed.workers.parity import hf_logit_diff, megatron_logits


def duplicate(layer: int):
    """Layouts whose decoder layer ``layer`` reads the HF tensors of layer ``layer - 1``."""
    pattern = re.compile(rf"^model\.layers\.{layer}\.")

    def shift(lay: ParamLayout) -> ParamLayout:
        def name(n: str) -> str:
            return pattern.sub(f"model.layers.{layer - 1}.", n)

        pieces = tuple(tuple(Piece(name(p.hf_name), p.start, p.stop) for p in r) for r in lay.pieces)
        return dataclasses.replace(lay, pieces=pieces)

    return shift


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--last", type=int, default=None)
    ap.add_argument("--corrupt", default=None, choices=[None, "duplicate"])
    ap.add_argument("--save", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(1, a.pp, device="cpu")
    overrides = tuple(
        (f"num_layers_in_{k}_pipeline_stage", v) for k, v in (("first", a.first), ("last", a.last)) if v
    )
    results = {}
    orig = tables.param_layouts
    for arch in a.archs:
        path = os.path.join(a.models, arch)
        args = load_model_args(path)
        model = build_model(args, ps, options=TrainingOptions(transformer_overrides=overrides))
        if a.corrupt:
            shift = duplicate(args.num_layers - 1)  # the last stage's last layer
            tables.param_layouts = lambda *x, f=shift, **kw: [f(lay) for lay in orig(*x, **kw)]
        try:
            load_hf_weights(model, path, ps)
        finally:
            tables.param_layouts = orig
        model.eval()
        if a.save:
            from megatron.core import dist_checkpointing

            out_dir = os.path.join(a.save, arch)
            os.makedirs(out_dir, exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(), out_dir)
            if ps.rank == 0:  # the HF config beside it: what the checkpoint's model is
                import shutil

                shutil.copy(os.path.join(path, "config.json"), out_dir)
        mbs, outs = megatron_logits(model, ps, args.vocab_size)
        offsets = [torch.zeros(1, dtype=torch.int64) for _ in range(ps.world_size)]
        dist.all_gather(offsets, torch.tensor([model.layer_offset]))
        if ps.is_last_stage:
            diff, top = hf_logit_diff(path, mbs, outs)
            results[arch] = {
                "max_diff": diff,
                "max_logit": top,
                "stage_layers": list(model.stage_layers),
                "layer_offset_per_rank": [int(x) for x in offsets],
            }
    if results:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
