"""Benchmark: generation in the trainer's engine against a standalone ``sglang.Engine``, same batch.

    python bench/rollout.py --tp 1 --out bench_out/rollout_tp1          # 1 GPU
    python bench/rollout.py --tp 2 --out bench_out/rollout_tp2          # 2 GPUs
    python bench/rollout.py --model qwen3-30b-a3b --layers 4 --prompts 128 --graphs on \\
        --out bench_out/rollout_moe                                     # MoE, 1 GPU

--model picks the shape of the random HF model written under --out/model: Qwen2.5-1.5B (dense, the
default) or Qwen3-30B-A3B (Qwen3-MoE: 128 experts of 768, top-8, on every layer) cut to --layers
decoder layers (4 by default: ~3.1B parameters, 6.2 GB of bf16). Both sides see the same directory,
so the same MoE batch; the trainer's actor has expert parallelism 1 (every rank holds every expert).

For CUDA graphs on and off (--graphs), one process tree per mode:
  standalone  a fresh python process starts ``sglang.Engine`` on the HF model directory (its own
              weights, the same arguments as the trainer's engine: megatron_rl.rollout.sglang_start.
              engine_arguments) and generates;
  trainer     ``torchrun --nproc_per_node=TP`` builds the Megatron actor from the same directory, starts
              the engine as the trainer does (SGLangEngine), streams the weights into it (sync_weights),
              releases and resumes its memory once (as every colocated step does), and generates through
              the trainer's collective path.
Each generates, for every --prompts count (128 and 512 by default), the same prompts of --prompt-len
random token ids, n=1, --new-tokens new tokens with EOS ignored (every response has exactly that many
tokens), temperature 1; one warm-up generate of the same batch first, then the timed one. tokens/s =
prompts x new tokens / seconds. Rank 0 writes --out/summary.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_step import add_model_args, model_shape  # noqa: E402

MODELS = ("qwen2.5-1.5b", "qwen3-30b-a3b")


def _prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 3) for _ in range(length)] for _ in range(count)]


def _rollout_cfg(a: argparse.Namespace, graphs: bool):
    from megatron_rl.config import RolloutConfig

    return RolloutConfig(
        name="sglang",
        dtype="bfloat16",  # the trainer resolves None from the actor's params_dtype (bf16 here)
        tensor_model_parallel_size=a.tp,
        gpu_memory_utilization=a.gpu_memory_utilization,
        enable_cuda_graph=graphs,
    )


def standalone(a: argparse.Namespace, graphs: bool) -> dict:
    """(a): sglang.Engine in this process, on the HF directory's own weights."""
    import sglang

    from megatron_rl.rollout.sglang_start import engine_arguments

    with open(os.path.join(a.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    kwargs = engine_arguments(_rollout_cfg(a, graphs), a.model_dir, a.tp, 0, seed=0)
    kwargs["load_format"] = "auto"
    t0 = time.perf_counter()
    engine = sglang.Engine(**kwargs)
    out = {"engine_start_s": time.perf_counter() - t0}
    sampling = {"max_new_tokens": a.new_tokens, "temperature": 1.0, "ignore_eos": True}
    for count in a.prompts:
        prompts = _prompts(vocab, count, a.prompt_len)
        engine.generate(input_ids=prompts, sampling_params=sampling)  # warm-up
        t0 = time.perf_counter()
        res = engine.generate(input_ids=prompts, sampling_params=sampling)
        seconds = time.perf_counter() - t0
        tokens = sum(len(r["output_ids"]) for r in res)
        out[str(count)] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    engine.shutdown()
    return out


def in_trainer(a: argparse.Namespace, graphs: bool) -> dict | None:
    """(b): the trainer's engine and weight path, under torchrun (every rank calls this)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.loading import load_model_args_any, load_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine
    from megatron_rl.rollout.reshard import sync_weights

    ps = init_parallel(a.tp, 1, device="cuda")
    args = load_model_args_any(a.model_dir)  # an MoE config.json gives MoE args: experts built, filled
    actor = build_model(args, ps, role="actor", dtype=torch.bfloat16)
    load_weights(actor, a.model_dir, ps)
    cfg = _rollout_cfg(a, graphs)
    t0 = time.perf_counter()
    engine = create_engine(cfg, a.model_dir, args, ps, seed=0)
    out = {"engine_start_s": time.perf_counter() - t0}
    # A colocated step: release (training runs), resume, stream the weights in.
    t0 = time.perf_counter()
    engine.release_memory()
    engine.resume_memory()
    out["release_resume_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync_weights(actor, ps, engine, cfg.update_weights_bucket_megabytes, torch.bfloat16)
    torch.cuda.synchronize()
    out["sync_s"] = time.perf_counter() - t0
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=a.new_tokens, stop_token_ids=[], seed=0)
    for count in a.prompts:
        # Every rank is one DP replica's shard holder; with TP=R all R ranks pass the same prompts.
        prompts = _prompts(args.vocab_size, count, a.prompt_len) if ps.dp_size == 1 else None
        assert prompts is not None, "bench/rollout.py runs one replica (training TP = rollout TP)"
        engine.generate(prompts, params)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        dist.barrier()
        seconds = time.perf_counter() - t0
        tokens = sum(len(g.token_ids) for gs in gens for g in gs)
        out[str(count)] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    engine.shutdown()
    destroy_parallel()
    return out if ps.rank == 0 else None


def _prepare(a: argparse.Namespace) -> str:
    """A random HF model of the --model shape (bf16, HF init) under --out, reused when present; a
    directory of another shape there is refused rather than measured."""
    import torch

    from megatron_rl.models.random_hf import save_random_hf_model

    arch, dims = model_shape(a.model, a.layers)
    path = os.path.join(a.out, "model")
    config = os.path.join(path, "config.json")
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    want = (arch, dims["num_hidden_layers"], dims["hidden_size"], dims["vocab_size"])
    if os.path.isfile(config):
        with open(config) as f:
            saved = json.load(f)
        have = tuple(saved.get(k) for k in keys)
        if have != want:
            raise SystemExit(
                f"bench: {path} holds another model ({', '.join(keys)} = {have}; --model {a.model} "
                f"needs {want}); use another --out"
            )
    else:
        v = dims["vocab_size"]
        ids = dict(pad_token_id=v - 3, bos_token_id=v - 2, eos_token_id=v - 1)
        save_random_hf_model(path, arch, seed=0, init="hf", dtype=torch.bfloat16, **dims, **ids)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, MODELS)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--graphs", choices=["on", "off", "both"], default="both")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", choices=["standalone", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--graph", choices=["on", "off"], help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker:  # one measurement, in this process (tree)
        result = (standalone if a.worker == "standalone" else in_trainer)(a, a.graph == "on")
        if result is not None:
            with open(os.path.join(a.out, f"{a.worker}_graphs_{a.graph}.json"), "w") as f:
                json.dump(result, f, indent=1)
        return

    os.makedirs(a.out, exist_ok=True)
    model_dir = _prepare(a)
    common = ["--tp", str(a.tp), "--prompts", *map(str, a.prompts), "--prompt-len", str(a.prompt_len)]
    common += ["--new-tokens", str(a.new_tokens), "--out", a.out, "--model-dir", model_dir]
    common += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    moe = f", {experts} experts, top-{hf['num_experts_per_tok']}" if experts else ""
    shape = f"{a.model} shape, {hf['num_hidden_layers']} layers{moe} (random weights), bf16"
    summary: dict = {"args": vars(a), "model": shape, "runs": {}}
    for graph in ["on", "off"] if a.graphs == "both" else [a.graphs]:
        for worker in ("standalone", "trainer"):
            me = [os.path.abspath(__file__), *common, "--worker", worker, "--graph", graph]
            if worker == "standalone":
                cmd = [sys.executable, *me]
            else:
                cmd = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={a.tp}",
                    *me,
                ]
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            path = os.path.join(a.out, f"{worker}_graphs_{graph}.json")
            summary["runs"][f"{worker}/graphs_{graph}"] = json.load(open(path)) if rc == 0 else {"rc": rc}
    for graph in ["on", "off"] if a.graphs == "both" else [a.graphs]:
        s, t = summary["runs"][f"standalone/graphs_{graph}"], summary["runs"][f"trainer/graphs_{graph}"]
        for count in map(str, a.prompts):
            if count in s and count in t:
                ratio = t[count]["tokens_per_s"] / s[count]["tokens_per_s"]
                summary.setdefault("trainer_vs_standalone", {})[f"graphs_{graph}/{count}"] = ratio
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
