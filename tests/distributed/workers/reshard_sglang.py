"""Worker (GPU, torchrun): training TP x DP -> reshard stream -> SGLang engines of rollout TP R.

Checks the multi-rank paths that one process cannot: each rank of a rollout group handing its own
GPU's bucket to the SGLang worker on that GPU, and prompts/results routed through the collective
generate. Per DP leader: SGLang greedy vs transformers on the same bf16 weights (model a, then
model b after a sync; see ``judge_greedy``); every rank records what it received. Rank 0 writes
the records.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.config import RolloutConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import build_model, load_hf_weights
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout import SamplingParams, create_engine
from megatron_rl.rollout.reshard import sync_weights


def judge_greedy(path: str, prompts: list[list[int]], outs: list[list[int]], device) -> dict:
    """Greedy outputs (equal-length prompts, equal-length outputs) vs transformers on the same weights.

    exact: fraction of sequences equal to transformers' bf16 greedy ``generate``;
    argmax / worst_gap: the outputs teacher-forced through the same bf16-rounded weights in fp32 --
    fraction of tokens that are the argmax, and the largest (max logit - chosen logit).
    """
    from transformers import AutoModelForCausalLM

    new = len(outs[0])
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ref.generation_config.eos_token_id = None
    x = torch.tensor(prompts, device=device)
    y = torch.tensor(outs, device=device)
    with torch.no_grad():
        gen = ref.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
        exact = (gen[:, x.shape[1] :] == y).all(-1).float().mean().item()
        ref = ref.float()
        logits = ref(torch.cat([x, y], dim=1)).logits[:, x.shape[1] - 1 : -1]  # [B, new, V]
        gap = logits.max(-1).values - logits.gather(-1, y[..., None])[..., 0]
    del ref
    torch.cuda.empty_cache()
    return {"exact": exact, "argmax": (gap == 0).float().mean().item(), "worst_gap": gap.max().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, 1, device="cuda")
    paths = [os.path.join(a.models, x) for x in ("a", "b")]
    args = load_model_args(paths[0])
    model = build_model(args, ps, dtype=torch.bfloat16)
    cfg = RolloutConfig(
        name="sglang",
        dtype="bfloat16",
        tensor_model_parallel_size=a.rollout_tp,
        gpu_memory_utilization=0.25,
        enable_cuda_graph=False,
        max_num_batched_tokens=4096,
    )
    engine = create_engine(cfg, paths[0], args, ps, seed=0)
    g = torch.Generator().manual_seed(50 + ps.dp_rank)
    prompts = torch.randint(3, args.vocab_size, (16, 10), generator=g).tolist()
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    rec = {"rank": ps.rank, "dp_rank": ps.dp_rank, "tp_rank": ps.tp_rank, "prompts": prompts}
    for tag, path in zip(("a", "b"), paths, strict=True):
        load_hf_weights(model, path, ps)
        stats = sync_weights(model, ps, engine, bucket_megabytes=1, dtype=torch.bfloat16)
        out = [per[0].token_ids for per in engine.generate(prompts, greedy)]
        rec[f"buckets_{tag}"] = stats["buckets"]
        rec[f"out_{tag}"] = out
        if ps.tp_rank == 0:
            rec[f"judge_{tag}"] = judge_greedy(path, prompts, out, ps.device)
    samp = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, return_logprobs=True, seed=3)
    s = engine.generate(prompts[:4], samp)
    rec["sample_shape"] = [[len(x.token_ids) for x in per] for per in s]
    everyone = [None] * ps.world_size
    dist.all_gather_object(everyone, rec)
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(everyone, f)
    engine.shutdown()
    destroy_parallel()


if __name__ == "__main__":
    main()
