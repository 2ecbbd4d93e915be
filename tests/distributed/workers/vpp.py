"""Worker: logits of models built as interleaved pipelines (megatron's model chunks,
*.megatron.virtual_pipeline_model_parallel_size) vs the HF model, and torch_dist checkpoints across
(PP, VPP) layouts.

Writes {arch: {"max_diff", "max_logit", "stage_layers", "chunk_offsets", "filler_ok", "load_exact"}}
from the last stage to --out. ``--corrupt duplicate`` reads the last layer from the HF layer before it
(the negative control). ``--stream``: the weight stream to the engine gives the HF files
(``stream_exact``). ``--save DIR`` saves each model's torch_dist checkpoint under DIR/<arch>;
``--load DIR`` fills a second model of this layout from DIR/<arch> (saved at another layout) and
compares every parameter with the HF-filled one bit for bit (``load_exact``). ``filler_ok``: an odd
number of micro-batches (filled up to a multiple of PP by run_pipeline) gives the same outputs.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights, named_global_params
from megatron_rl.models.chunks import chunks_of
from megatron_rl.models.forward import gather_tp, run_pipeline
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.weights import tables
from tests.distributed.workers.parity import hf_logit_diff, megatron_logits
from tests.distributed.workers.uneven_pp import duplicate


def stream_is_exact(model, ps, path: str) -> bool:
    """The reshard stream's HF tensors (small buckets: many of them, every stage's chunks) equal the HF
    files bit for bit, each tensor sent once (a tied LM head is not sent)."""
    from safetensors.torch import load_file

    from megatron_rl.rollout.reshard import iter_hf_buckets

    got: dict[str, torch.Tensor] = {}
    sent_twice = False
    for bucket in iter_hf_buckets(model, ps, 20_000, torch.float32):
        for name, t in bucket:
            sent_twice |= name in got
            got[name] = t.clone()
    want = load_file(os.path.join(path, "model.safetensors"))
    missing = set(want) - set(got) - ({"lm_head.weight"} if model.args.tie_embeddings else set())
    return not sent_twice and not missing and all(torch.equal(got[n], want[n]) for n in got)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--last", type=int, default=None)
    ap.add_argument("--corrupt", default=None, choices=[None, "duplicate"])
    ap.add_argument("--save", default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--stream", action="store_true", help="check the weight stream to the engine")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, device="cpu")
    overrides = tuple(
        (f"num_layers_in_{k}_pipeline_stage", v) for k, v in (("first", a.first), ("last", a.last)) if v
    )
    # megatron runs MoE layers at TP > 1 with sequence parallelism only
    options = TrainingOptions(
        sequence_parallel=a.tp > 1, virtual_pipeline=a.vpp, transformer_overrides=overrides
    )
    results = {}
    orig = tables.param_layouts
    for arch in a.archs:
        path = os.path.join(a.models, arch)
        args = load_model_args(path)
        model = build_model(args, ps, options=options)
        if a.corrupt:
            shift = duplicate(args.num_layers - 1)  # the last virtual stage's last layer
            tables.param_layouts = lambda *x, f=shift, **kw: [f(lay) for lay in orig(*x, **kw)]
        try:
            load_hf_weights(model, path, ps)
        finally:
            tables.param_layouts = orig
        model.eval()
        if a.save:
            from megatron_rl.weights.ckpt_write import save_torch_dist

            save_torch_dist(model, ps, os.path.join(a.save, arch))
        load_exact = None
        if a.load:
            from megatron_rl.weights.torch_dist import load_torch_dist

            other = build_model(args, ps, options=options)
            load_torch_dist(other, ps, os.path.join(a.load, arch))
            want, got = named_global_params(model), named_global_params(other)
            exact = set(want) == set(got) and all(torch.equal(want[n], got[n]) for n in want)
            same = torch.tensor([int(exact)])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            load_exact = bool(same.item())
        mbs, outs = megatron_logits(model, ps, args.vocab_size)
        vocab = args.vocab_size
        with torch.no_grad():  # three micro-batches: run_pipeline fills up to a multiple of PP
            odd = run_pipeline(
                model, ps, [*mbs, mbs[0]], lambda mb, out, v=vocab: gather_tp(out, ps)[..., :v], True
            )
        stream_exact = stream_is_exact(model, ps, path) if a.stream else None
        offsets = torch.tensor([c.layer_offset for c in chunks_of(model)])
        gathered = [torch.zeros_like(offsets) for _ in range(ps.pp_size)]
        dist.all_gather(gathered, offsets, group=ps.pp_group)
        if ps.is_last_stage and ps.tp_rank == 0:
            diff, top = hf_logit_diff(path, mbs, outs)
            same_outs = [torch.equal(x, y) for x, y in zip(odd, [*outs, outs[0]], strict=False)]
            filler_ok = len(odd) == 3 and all(same_outs)
            results[arch] = {
                "max_diff": diff,
                "max_logit": top,
                "stage_layers": list(model.stage_layers),
                "chunk_offsets": [g.tolist() for g in gathered],
                "filler_ok": filler_ok,
                "load_exact": load_exact,
                "stream_exact": stream_exact,
            }
    if results:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
