"""Worker: reshard a Megatron actor (TP x PP x DP on gloo) into the transformers engine and check it.

Per architecture (every rank takes part; checks run where the HF engine lives, the DP leaders):
  * logits of the engine's model == Megatron forward (run_pipeline + gather_tp) on a left-padded batch;
  * the engine's weights == the original safetensors, bit for bit (fp32);
  * a tiny bucket size gives many buckets and the same weights, bit for bit;
  * negative control: the stream through a wrong qkv layout (k and v swapped) makes the logits differ.
For ``--gen-arch``: greedy generation is deterministic and equals transformers' ``generate`` on a
model loaded from the original directory (with a stop token taken from the greedy output); seeded
sampling reproduces, another seed differs, engine log-probs equal teacher-forced reference log-probs.

Every rank writes a record; rank 0 dumps the list to --out.
"""

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.config import RolloutConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights
from megatron_rl.models.forward import broadcast_from_last_stage, gather_tp, run_pipeline
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout import SamplingParams, create_engine
from megatron_rl.rollout.reshard import sync_weights
from megatron_rl.weights import tables
from megatron_rl.weights.tables import ParamLayout


@dataclasses.dataclass
class MB:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def swap_kv(lay: ParamLayout) -> ParamLayout:
    """A plausible layout bug: each KV group read as [q | v | k] instead of [q | k | v]."""
    if "linear_qkv" not in lay.name:
        return lay
    pieces = []
    for rank in lay.pieces:
        rank = list(rank)
        for i in range(0, len(rank), 3):
            rank[i + 1], rank[i + 2] = rank[i + 2], rank[i + 1]
        pieces.append(tuple(rank))
    return dataclasses.replace(lay, pieces=tuple(pieces))


def engine_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def logits_diff(model, engine, ps, args, mb: MB) -> tuple[float, float]:
    """max |HF engine - Megatron| over real tokens, and max |logit| (on the DP leader; -1 elsewhere)."""
    with torch.no_grad():
        outs = run_pipeline(model, ps, [mb], lambda m, out: gather_tp(out, ps)[..., : args.vocab_size], True)
        meg = outs[0].contiguous() if ps.is_last_stage else None
        meg = broadcast_from_last_stage(meg, ps, (*mb.input_ids.shape, args.vocab_size), torch.float32)
        if engine.model is None:
            return -1.0, -1.0
        hf = engine.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    real = mb.attention_mask.bool()
    return (hf - meg)[real].abs().max().item(), hf[real].abs().max().item()


def check_arch(path: str, ps, control: bool) -> dict:
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
    rec: dict = {}
    stats = sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)
    rec["buckets_default"] = stats["buckets"]
    rec["bytes"] = stats["bytes"]
    rec["max_diff"], rec["max_logit"] = logits_diff(model, engine, ps, args, mb)
    if engine.model is not None:
        from safetensors.torch import load_file

        orig = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                orig.update(load_file(os.path.join(path, f)))
        mine = engine_weights(engine)
        rec["weights_vs_files"] = max((mine[k] - v).abs().max().item() for k, v in orig.items())
        rec["weights_checked"] = len(orig)
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()  # the small-bucket sync must rewrite every tensor
    # ~4 KiB buckets: many of them, same bytes
    stats = sync_weights(model, ps, engine, bucket_megabytes=4096 / 2**20, dtype=torch.float32)
    rec["buckets_small"] = stats["buckets"]
    rec["bytes_small"] = stats["bytes"]
    if engine.model is not None:
        now = engine_weights(engine)
        rec["small_vs_default"] = max((now[k] - v).abs().max().item() for k, v in mine.items())
    if control:
        orig_layouts = tables.param_layouts
        tables.param_layouts = lambda a, tp, role="actor": [swap_kv(x) for x in orig_layouts(a, tp, role)]
        try:
            sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)
        finally:
            tables.param_layouts = orig_layouts
        rec["control_diff"], _ = logits_diff(model, engine, ps, args, mb)
        rec["skip"] = check_skipped_bucket(model, engine, ps, args)
        sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)
    return rec, model, engine, args


def check_skipped_bucket(model, engine, ps, args) -> dict:
    """A sync that drops one bucket before the engine (the stream's test hook) over an engine whose copy
    is stale (zeroed): every rank raises WeightSyncError naming that bucket's first tensor."""
    from megatron_rl.rollout import reshard

    small = 4096
    plan = reshard.plan_buckets(args, ps.tp_size, ps.pp_size, small, 4)
    k = len(plan) // 2
    if engine.model is not None:
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()
    target = reshard._syncs + 1
    reshard.stream_fault = lambda sync, i, bucket: sync == target and i == k  # drop bucket k
    try:
        sync_weights(model, ps, engine, bucket_megabytes=small / 2**20, dtype=torch.float32)
        message = None
    except reshard.WeightSyncError as e:
        message = str(e)
    finally:
        reshard.stream_fault = None
    # the same sync without the fault passes (the check itself is quiet on a correct stream)
    sync_weights(model, ps, engine, bucket_megabytes=small / 2**20, dtype=torch.float32)
    return {
        "message": message,
        "bucket": k + 1,
        "buckets": len(plan),
        "tensor": plan[k].params[0].tensors[0].name,
    }


def as_lists(gens):
    return [[(g.token_ids, g.logprobs, g.finish_reason) for g in per] for per in gens]


def check_generation(path: str, model, engine, args, ps) -> dict:
    g = torch.Generator().manual_seed(100 + ps.dp_rank)
    prompts = [torch.randint(3, args.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    rec: dict = {"prompts": prompts}
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    g1 = engine.generate(prompts, greedy)
    g2 = engine.generate(prompts, greedy)
    rec["greedy"] = as_lists(g1)
    rec["greedy_deterministic"] = as_lists(g1) == as_lists(g2)
    # Stop token: the first token of the greedy outputs that occurs first at a position >= 1, so that
    # the cut lands inside a response.
    stop = next(
        t for per in g1 for j, t in enumerate(per[0].token_ids) if j and t not in per[0].token_ids[:j]
    )
    gs = engine.generate(prompts, dataclasses.replace(greedy, stop_token_ids=[stop]))
    rec["stop"] = stop
    rec["greedy_stop"] = as_lists(gs)
    samp = SamplingParams(
        n=3, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=6, seed=123, return_logprobs=True
    )
    a1 = engine.generate(prompts, samp)
    a2 = engine.generate(prompts, samp)
    a3 = engine.generate(prompts, dataclasses.replace(samp, seed=124))
    rec["sample"] = as_lists(a1)
    rec["sample_reproducible"] = as_lists(a1) == as_lists(a2)
    rec["sample_other_seed_differs"] = [x[0] for p in as_lists(a1) for x in p] != [
        x[0] for p in as_lists(a3) for x in p
    ]
    if engine.model is not None:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        ref_out = []
        lp_diff = 0.0
        with torch.no_grad():
            for p in prompts:
                x = torch.tensor([p])
                out = ref.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=8,
                    do_sample=False,
                    eos_token_id=stop,
                    pad_token_id=0,
                )
                ref_out.append(out[0, len(p) :].tolist())
            for p, per in zip(prompts, a1, strict=True):
                for gen in per:
                    full = torch.tensor([p + gen.token_ids])
                    logits = ref(input_ids=full).logits[0, len(p) - 1 : -1] / samp.temperature
                    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
                    lp_diff = max(lp_diff, (lp - torch.tensor(gen.logprobs)).abs().max().item())
        rec["reference_stop"] = ref_out
        rec["logprob_diff"] = lp_diff
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--gen-arch", required=True)
    ap.add_argument("--control-arch", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, device="cpu")
    rec = {"rank": ps.rank, "dp_rank": ps.dp_rank, "tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "archs": {}}
    for arch in a.archs:
        path = os.path.join(a.models, arch)
        r, model, engine, args = check_arch(path, ps, control=arch == a.control_arch)
        rec["archs"][arch] = r
        if arch == a.gen_arch:
            rec["gen"] = check_generation(path, model, engine, args, ps)
    everyone = [None] * ps.world_size
    dist.all_gather_object(everyone, rec)
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(everyone, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
