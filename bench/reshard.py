"""Benchmark: reshard stream (+ SGLang update) of a Qwen2.5-1.5B-shaped actor at TP = the GPUs.

    torchrun --nproc_per_node=2 bench/reshard.py --out reshard.json    # TP=2 (rollout TP=2)
    torchrun --nproc_per_node=1 bench/reshard.py --out reshard.json    # TP=1: the bound is a copy

Same run, same bytes (the HF tensors the stream produces, bf16):
  bound       one NCCL all_gather_into_tensor over the TP group whose output has those bytes;
  reshard     iter_hf_buckets drained with no consumer (pack, TP gather, scatter into HF buckets);
  sync        sync_weights into an SGLang engine of the same TP (reshard + update_weights_from_tensor);
plus the peak extra device memory of the stream, release/resume times, and a greedy generate after
the sync (the engine answers with the streamed weights). Weights are random (O(1) scale), built
directly on the GPU; nothing is read from disk. Rank 0 prints a summary and writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import zlib

import torch
import torch.distributed as dist


def qwen_args():
    from transformers import Qwen2Config

    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import QWEN25_1_5B

    hf = Qwen2Config(**QWEN25_1_5B, pad_token_id=0, bos_token_id=1, eos_token_id=2).to_dict()
    hf["architectures"] = ["Qwen2ForCausalLM"]
    return model_args_from_hf_config(hf)


@torch.no_grad()
def randomize(model, ps) -> None:
    """O(1) weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms in [0.5, 1.5]; TP-split
    tensors differ per TP rank, replicated ones are identical on every rank."""
    for name, p in model.named_parameters():
        split = getattr(p, "tensor_model_parallel", False)
        seed = zlib.crc32(name.encode()) + (1000 * ps.tp_rank if split else 0)
        g = torch.Generator(device=p.device).manual_seed(seed)
        if p.ndim == 2:
            fan_in = p.shape[1] * (ps.tp_size if split and getattr(p, "partition_dim", 0) == 1 else 1)
            scale = 1.0 if "word_embeddings" in name else fan_in**-0.5
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * scale)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * 0.5)
        else:
            p.copy_(0.5 + torch.rand(p.shape, generator=g, device=p.device))


def timed(fn, repeats: int, warmup: int = 1) -> dict:
    out = []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(out), "min_s": min(out), "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 128, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "none"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    a = ap.parse_args()

    from megatron_rl.config import RolloutConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine
    from megatron_rl.rollout.reshard import iter_hf_buckets, plan_buckets, sync_weights

    ps = init_parallel(int(os.environ.get("WORLD_SIZE", "1")), 1, device="cuda")  # TP over every GPU
    args = qwen_args()
    model = build_model(args, ps, dtype=torch.bfloat16)
    randomize(model, ps)
    res: dict = {
        "model": "Qwen2.5-1.5B shape (random weights), bf16",
        "layout": f"train TP={ps.tp_size} PP={ps.pp_size} DP={ps.dp_size}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    numel = sum(b.numel for b in plan_buckets(args, ps.tp_size, ps.pp_size, 1 << 40, 2))
    nbytes = numel * 2
    res["stream_bytes"] = nbytes

    # The bound: one all_gather_into_tensor whose output has the stream's bytes.
    per_rank = -(-numel // ps.tp_size)
    bufs = {
        "in": torch.randn(per_rank, device=ps.device).to(torch.bfloat16),
        "out": torch.empty(per_rank * ps.tp_size, dtype=torch.bfloat16, device=ps.device),
    }

    def gather() -> None:
        dist.all_gather_into_tensor(bufs["out"], bufs["in"], group=ps.tp_group)

    res["bound"] = timed(gather, a.repeats, warmup=3)
    bufs.clear()
    torch.cuda.empty_cache()

    def drain(mb: int) -> None:
        for _ in iter_hf_buckets(model, ps, mb << 20, torch.bfloat16):
            pass

    res["reshard"] = {}
    for mb in a.bucket_mb:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = timed(lambda mb=mb: drain(mb), a.repeats)
        r["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        r["buckets"] = len(plan_buckets(args, ps.tp_size, ps.pp_size, mb << 20, 2))
        r["x_bound"] = r["median_s"] / res["bound"]["median_s"]
        res["reshard"][mb] = r

    if a.engine == "sglang":
        cfg = RolloutConfig(
            name="sglang",
            dtype="bfloat16",
            tensor_model_parallel_size=ps.tp_size,
            gpu_memory_utilization=a.gpu_memory_utilization,
            enable_cuda_graph=False,
            max_num_batched_tokens=8192,
        )
        t0 = time.perf_counter()
        engine = create_engine(cfg, "", args, ps, seed=0)
        res["engine_start_s"] = time.perf_counter() - t0
        res["sync"] = {}
        for mb in a.bucket_mb:
            stats = {}

            def run(mb=mb, stats=stats):
                stats.update(sync_weights(model, ps, engine, mb, torch.bfloat16))

            r = timed(run, max(2, a.repeats // 2))
            r["buckets"] = stats["buckets"]
            r["bytes"] = stats["bytes"]
            r["x_bound"] = r["median_s"] / res["bound"]["median_s"]
            r["update_s"] = r["median_s"] - res["reshard"][mb]["median_s"]
            res["sync"][mb] = r
        g = torch.Generator().manual_seed(ps.dp_rank)
        prompts = torch.randint(3, args.vocab_size, (64, 128), generator=g).tolist()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=64))
        dt = time.perf_counter() - t0
        res["generate"] = {
            "prompts": 64,
            "new_tokens": sum(len(x[0].token_ids) for x in gens),
            "seconds": dt,
            "distinct_first_tokens": len({x[0].token_ids[0] for x in gens}),
        }
        t0 = time.perf_counter()
        engine.release_memory()
        res["release_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.resume_memory()
        res["resume_s"] = time.perf_counter() - t0
        engine.shutdown()

    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        gb = nbytes / 1e9
        b = res["bound"]["median_s"]
        print(f"stream {gb:.2f} GB bf16; bound (all_gather_into_tensor) {b * 1e3:.1f} ms = {gb / b:.0f} GB/s")
        for mb, r in res["reshard"].items():
            print(
                f"reshard  bucket {mb:5d} MiB: {r['median_s'] * 1e3:7.1f} ms ({r['x_bound']:.2f}x bound), "
                f"{r['buckets']} buckets, peak extra {r['peak_extra_bytes'] / 2**20:.0f} MiB"
            )
        for mb, r in res.get("sync", {}).items():
            print(
                f"sync     bucket {mb:5d} MiB: {r['median_s'] * 1e3:7.1f} ms ({r['x_bound']:.2f}x bound), "
                f"engine update {r['update_s'] * 1e3:.1f} ms"
            )
        if "generate" in res:
            print(f"engine start {res['engine_start_s']:.1f} s; generate {res['generate']}")
            print(f"release {res['release_s']:.3f} s, resume {res['resume_s']:.3f} s")
    destroy_parallel()


if __name__ == "__main__":
    main()
