"""Benchmark: reshard stream (+ SGLang update) of a random actor at TP = the GPUs.

    torchrun --nproc_per_node=2 bench/reshard.py --out reshard.json    # TP=2 (rollout TP=2)
    torchrun --nproc_per_node=1 bench/reshard.py --out reshard.json    # TP=1: the bound is a copy
    torchrun --nproc_per_node=1 bench/reshard.py --model qwen3-30b-a3b --layers 4 --out reshard_moe.json

--model picks the shape: Qwen2.5-1.5B (dense, the default), or Qwen3-30B-A3B (Qwen3-MoE: 128 experts
of 768, top-8, on every layer) cut to --layers decoder layers (4 by default: ~3.1B parameters, 6.2 GB
of bf16; the stream then carries 128 x 3 expert matrices per layer, the router [128, 2048] and the
embedding and LM head). The actor has expert parallelism 1 and expert TP = TP, so every rank holds
every expert; the engine builds the same shape from the model's config alone (no model directory).
--graphs on|off: the engine's decode CUDA graphs (on by default, as the trainer starts it).

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
import sys
import time
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_rl.model_args import ModelArgs
    from megatron_rl.parallel import ParallelState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_step import add_model_args, model_shape  # noqa: E402

MODELS = ("qwen2.5-1.5b", "qwen3-30b-a3b")
SHAPE_NAMES = {"qwen2.5-1.5b": "Qwen2.5-1.5B", "qwen3-30b-a3b": "Qwen3-30B-A3B"}


def hf_model_args(model: str, layers: int | None) -> ModelArgs:
    """ModelArgs of a --model shape (bench/ppo_step.py's table), from its HF config alone."""
    import transformers

    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import ARCH_CLASSES

    arch, dims = model_shape(model, layers)
    config_class, lm_class = ARCH_CLASSES[arch]
    config = getattr(transformers, config_class)(**dims, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf = config.to_dict()
    hf["architectures"] = [lm_class]
    return model_args_from_hf_config(hf)


def describe(model: str, args: ModelArgs) -> str:
    """The shape and its layer count, e.g. "Qwen3-30B-A3B shape, 4 layers, 128 experts, top-8 (...)"."""
    layers = f"{args.num_layers} layer{'s' * (args.num_layers != 1)}"
    moe = f", {args.num_experts} experts, top-{args.moe_top_k}" if args.is_moe else ""
    return f"{SHAPE_NAMES[model]} shape, {layers}{moe} (random weights), bf16"


@torch.no_grad()
def randomize(model: torch.nn.Module, ps: ParallelState) -> None:
    """O(1) weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms in [0.5, 1.5]; TP-split
    tensors differ per TP rank (an expert's per expert-TP rank), replicated ones are identical on every
    rank. The seed comes from the global name (global layer and expert index), so an expert's weights
    do not depend on which EP rank holds it. MoE: each expert's linear_fc1 [2 * ffn / ETP, H] and
    linear_fc2 [H, ffn / ETP] (SequentialMLP) and the router [E, H] are matrices like any other."""
    from megatron_rl.models.builder import named_global_params

    for name, p in named_global_params(model).items():
        split = getattr(p, "tensor_model_parallel", False)
        expert = ".local_experts." in name
        tp_size, tp_rank = (ps.etp_size, ps.etp_rank) if expert else (ps.tp_size, ps.tp_rank)
        seed = zlib.crc32(name.encode()) + (1000 * tp_rank if split else 0)
        g = torch.Generator(device=p.device).manual_seed(seed)
        if p.ndim == 2:
            fan_in = p.shape[1] * (tp_size if split and getattr(p, "partition_dim", 0) == 1 else 1)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, MODELS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 128, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "none"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--graphs", choices=["on", "off"], default="on", help="the engine's decode CUDA graphs")
    a = ap.parse_args()

    from megatron_rl.config import RolloutConfig
    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine
    from megatron_rl.rollout.reshard import iter_hf_buckets, plan_buckets, sync_weights

    ps = init_parallel(int(os.environ.get("WORLD_SIZE", "1")), 1, device="cuda")  # TP over every GPU
    args = hf_model_args(a.model, a.layers)
    model = build_model(args, ps, dtype=torch.bfloat16)
    randomize(model, ps)
    res: dict = {
        "model": describe(a.model, args),
        "layout": f"train TP={ps.tp_size} PP={ps.pp_size} DP={ps.dp_size}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    etp = ps.etp_size if args.is_moe else None  # as iter_hf_buckets plans it
    numel = sum(b.numel for b in plan_buckets(args, ps.tp_size, ps.pp_size, 1 << 40, 2, etp))
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
        r["buckets"] = len(plan_buckets(args, ps.tp_size, ps.pp_size, mb << 20, 2, etp))
        r["x_bound"] = r["median_s"] / res["bound"]["median_s"]
        res["reshard"][mb] = r

    if a.engine == "sglang":
        cfg = RolloutConfig(
            name="sglang",
            dtype="bfloat16",
            tensor_model_parallel_size=ps.tp_size,
            gpu_memory_utilization=a.gpu_memory_utilization,
            enable_cuda_graph=a.graphs == "on",
            max_num_batched_tokens=8192,
        )
        t0 = time.perf_counter()
        engine = create_engine(cfg, "", args, ps, seed=0)
        res["engine_start_s"] = time.perf_counter() - t0
        res["engine_cuda_graphs"] = cfg.enable_cuda_graph
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
        print(f"{res['model']}; {res['layout']}; engine CUDA graphs {a.graphs}")
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
