"""Worker: stream a mixture-of-experts actor (TP x EP on gloo) into the transformers engine and check it.

Per architecture (every rank takes part; checks run where an engine lives, the DP leaders):
  * engine logits == Megatron forward on a left-padded batch (O(1) random weights);
  * the engine's weights, read back under the checkpoint names, == the safetensors files bit for bit;
  * tiny buckets (one expert tensor each) give the same weights bit for bit;
  * negative control: a stream that sends experts 0 and 1 of every MoE layer under each other's names
    makes the logits differ;
  * a dropped bucket holding an expert of the last EP rank stops the sync with WeightSyncError naming it;
  * an SGLang engine over the whole world at expert parallelism = world size (stand-in FusedMoE layers:
    SGLang does not run on CPU): each rank's header names only its engine rank's block of experts, which
    lands in its fused weights equal to the files.

Every rank writes a record; rank 0 dumps the list to --out.
"""

import argparse
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist

from megatron_rl.config import RolloutConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights, named_global_params
from megatron_rl.models.forward import gather_tp, run_pipeline
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout import create_engine, reshard
from megatron_rl.rollout.reshard import iter_hf_buckets, sync_weights
from megatron_rl.rollout.sglang_loader import bucket_header, engine_expert_block, load_bucket
from megatron_rl.weights import tables
from megatron_rl.weights.tables import ParamLayout, Piece

_EXPERT = re.compile(r"\.experts\.([01])\.")
SMALL = 4096  # bytes: below one expert tensor of the tiny models, so each is a bucket of its own


@dataclasses.dataclass
class MB:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def swap_experts(lay: ParamLayout) -> ParamLayout:
    """Megatron expert 0 streamed under HF expert 1's names and vice versa."""

    def other(name: str) -> str:
        return _EXPERT.sub(lambda m: f".experts.{1 - int(m.group(1))}.", name)

    pieces = tuple(tuple(Piece(other(p.hf_name), p.start, p.stop) for p in r) for r in lay.pieces)
    return dataclasses.replace(lay, pieces=pieces)


def logits_diff(model, engine, ps, args, mb: MB) -> tuple[float, float]:
    """max |engine - Megatron| over real tokens and max |logit| (on a DP leader; -1 elsewhere)."""
    with torch.no_grad():
        outs = run_pipeline(model, ps, [mb], lambda m, out: gather_tp(out, ps)[..., : args.vocab_size], True)
        if engine.model is None:
            return -1.0, -1.0
        hf = engine.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    real = mb.attention_mask.bool()
    return (hf - outs[0])[real].abs().max().item(), hf[real].abs().max().item()


def engine_weights(engine, args) -> dict[str, torch.Tensor]:
    """The engine's weights under the checkpoint names (copies; the expert-score biases included)."""
    return {k: v.detach().clone() for k, v in engine._stream_targets().items()}


def zero_engine(engine) -> None:
    if engine.model is not None:
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()


def check_skipped_expert_bucket(model, engine, ps, args) -> dict:
    """Drop the bucket of the last expert's first tensor (layer 0; owned by the last EP rank) over a
    zeroed engine: every rank raises WeightSyncError naming that tensor."""
    plan = reshard.plan_buckets(args, ps.tp_size, ps.pp_size, SMALL, 4, ps.etp_size)
    last = args.num_experts - 1
    k = next(i for i, b in enumerate(plan) if b.params[0].layout.expert == last)
    zero_engine(engine)
    target = reshard._syncs + 1
    reshard.stream_fault = lambda sync, i, bucket: sync == target and i == k  # drop bucket k
    try:
        sync_weights(model, ps, engine, bucket_megabytes=SMALL / 2**20, dtype=torch.float32)
        message = None
    except reshard.WeightSyncError as e:
        message = str(e)
    finally:
        reshard.stream_fault = None
    return {
        "message": message,
        "bucket": k + 1,
        "buckets": len(plan),
        "tensor": plan[k].params[0].tensors[0].name,
    }


def engine_ep_block(model, ps, args, orig: dict[str, torch.Tensor]) -> dict:
    """This rank as engine rank ps.rank of one SGLang engine over the world at expert parallelism =
    world size: the experts its worker received (fused, or per expert under their names) and their
    largest difference from the files."""
    from tests.unit.test_sglang_loader import fake_model

    block = engine_expert_block(ps.rank, ps.world_size, ps.world_size, args.num_experts)
    fake = fake_model(args, 1, 0, ep=ps.world_size, ep_rank=ps.rank)
    for bucket in iter_hf_buckets(model, ps, 1 << 20, torch.float32):
        load_bucket(fake, [(bucket_header(bucket, block), bucket.flat)])
    routed = re.compile(r"layers\.(\d+)\..*\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
    got = {n: t for n, t in fake.loaded.items() if routed.search(n)}  # the per-expert path
    for name in orig:  # the fused path: [gate; up] rows and down of each expert of the block
        m = routed.search(name)
        if m is None or name in got or int(m[2]) not in block:
            continue
        ex = fake.model.layers[int(m[1])].mlp.experts
        f, local = ex.w13_weight.shape[1] // 2, int(m[2]) - block.start
        if m[3] in ("gate_proj", "w1"):
            got[name] = ex.w13_weight[local, :f]
        elif m[3] in ("up_proj", "w3"):
            got[name] = ex.w13_weight[local, f:]
        else:
            got[name] = ex.w2_weight[local]
    return {
        "experts": sorted({int(routed.search(n)[2]) for n in got}),
        "diff": max((t - orig[n]).abs().max().item() for n, t in got.items()),
        "tensors": len(got),
    }


def check_arch(path: str, ps) -> dict:
    args = load_model_args(path)
    model = build_model(args, ps)
    load_hf_weights(model, path, ps)
    model.eval()
    engine = create_engine(RolloutConfig(name="hf", dtype="float32"), path, args, ps, seed=0)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, args.vocab_size, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    mb = MB(ids, mask)
    rec: dict = {
        "experts": sorted(
            {
                int(m.group(1))
                for n in named_global_params(model)
                if (m := re.search(r"local_experts\.(\d+)", n))
            }
        )
    }
    sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)
    rec["max_diff"], rec["max_logit"] = logits_diff(model, engine, ps, args, mb)
    if engine.model is not None:
        from safetensors.torch import load_file

        orig = load_file(os.path.join(path, "model.safetensors"))
        mine = engine_weights(engine, args)
        rec["names_match_files"] = sorted(mine) == sorted(orig)
        rec["weights_vs_files"] = max((mine[k] - v).abs().max().item() for k, v in orig.items() if k in mine)
        rec["expert_tensors"] = sum(".experts." in k for k in orig)
    from safetensors.torch import load_file

    rec["engine_ep"] = engine_ep_block(model, ps, args, load_file(os.path.join(path, "model.safetensors")))
    zero_engine(engine)
    stats = sync_weights(model, ps, engine, bucket_megabytes=SMALL / 2**20, dtype=torch.float32)
    rec["buckets_small"] = stats["buckets"]
    if engine.model is not None:
        now = engine_weights(engine, args)
        rec["small_vs_default"] = max((now[k] - v).abs().max().item() for k, v in mine.items())

    orig_layouts = tables.param_layouts
    tables.param_layouts = lambda *a, **kw: [swap_experts(x) for x in orig_layouts(*a, **kw)]
    try:
        sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)
    finally:
        tables.param_layouts = orig_layouts
    rec["swapped_diff"], _ = logits_diff(model, engine, ps, args, mb)
    rec["skip"] = check_skipped_expert_bucket(model, engine, ps, args)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, 1, device="cpu", ep=a.ep, etp=a.etp)
    rec = {
        "rank": ps.rank,
        "tp_rank": ps.tp_rank,
        "ep_rank": ps.ep_rank,
        "leader": ps.tp_rank == 0,
        "archs": {},
    }
    for arch in a.archs:
        rec["archs"][arch] = check_arch(os.path.join(a.models, arch), ps)
    everyone = [None] * ps.world_size
    dist.all_gather_object(everyone, rec)
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(everyone, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
