"""Benchmark: real PPO steps of the trainer (actor + critic + reference, colocated with the engine).

    python bench/ppo_step.py --model qwen2.5-1.5b --nproc 1 --tp 1 --out bench_out/tp1
    python bench/ppo_step.py --model qwen2.5-1.5b --nproc 2 --tp 2 --out bench_out/tp2
    python bench/ppo_step.py --model tiny --device cpu --rollout hf --nproc 2 --tp 2 --out /tmp/b  # CPU
    python bench/ppo_step.py --model qwen3-30b-a3b --layers 4 --no-compare --out bench_out/moe  # MoE
    python bench/ppo_step.py --model tiny-moe --device cpu --rollout hf --nproc 1 --steps 2 --no-compare \
        --out /tmp/bmoe   # the MoE path on CPU
    python bench/ppo_step.py --model qwen2.5-1.5b --response-len 1024 --response-spread 32 1024 \
        --compare-dynamic --out bench_out/dynamic   # padded vs token-budget micro-batches
    python bench/ppo_step.py --model qwen2.5-1.5b --response-len 1024 --response-spread 32 1024 \
        --compare-packed --out bench_out/packed   # token-budget micro-batches: padded rows vs packed
    python bench/ppo_step.py --model qwen2.5-1.5b --compare-impl --out bench_out/te   # TE vs local layers
    python bench/ppo_step.py --model qwen2.5-1.5b --nproc 2 --compare-placement --out bench_out/placement
    python bench/ppo_step.py --model qwen2.5-1.5b --nproc 2 --compare-critic-placement --out bench_out/critic

It prepares a random HF model (Qwen2.5-1.5B shape; Qwen3-30B-A3B's, a Qwen3-MoE of 128 experts, top-8,
cut to --layers decoder layers (4 by default) so that it fits one GPU; or a tiny dense or MoE one), a
word-level tokenizer whose tokens are ``t0 .. t{V-1}`` (so prompts are plain token ids), and parquet
prompts of exactly --prompt-len tokens; then it runs ``torchrun -m megatron_rl.train`` unchanged, twice
unless --no-compare: colocated (the engine's memory released during training, and the training state
parked in host memory during generation: what the memory planner parks (the *_offload keys' default,
auto), or with --offload on every *.megatron.*_offload key on) and not (free_cache_engine=False, no
offload), and summarises the JSONL metrics (steps after the first, which includes compilation and
warm-up): per-phase seconds, tokens/s/GPU, actor MFU against the bf16 matmul peak measured in the same
run, peak memory (torch's allocated and reserved peaks in the trainer process: models, weight stream and
passes, not the engine, whose schedulers are processes of their own; and the device's, engine
included), the colocated/non-colocated peak-memory ratio, and for an MoE model the
router's expert load imbalance, aux loss (when moe_aux_loss_coeff > 0, e.g. --set
actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.001) and, with routing
replay (--set actor_rollout_ref.actor.router_replay.mode=R3), the share of routing decisions where
trainer and engine disagree. MFU counts an MoE model's active parameters. Responses are --response-len
tokens: a random model practically never samples EOS. The reward is a rule on the response text
(bench/synthetic_reward.py), so every phase of a real step runs.

With --response-spread LO HI each response's length is drawn uniformly from [LO, HI]
(bench/spread_train.py). With --compare-dynamic the two runs are instead both colocated: fixed-size
micro-batches padded to the batch's longest sequence ("padded"), then use_dynamic_bsz with token budgets
equal to the padded path's micro-batch sizes in tokens ("dynamic"), so that both hold the same peak
activations; perf/padding_fraction is reported for each; both run padded rows
(``*.megatron.use_remove_padding=false``). With --compare-packed the "dynamic" run is followed by the
same budgets with every micro-batch packed into one row ("packed", use_remove_padding=true, the
default): the gain of packing beyond token-budget micro-batches. With --compare-placement (2 GPUs) the
runs are colocated on both GPUs, then actor + critic + reference on GPU 0 with the engine alone on GPU 1
(trainer.placement.rollout=[1]) at max_staleness 0 and 1; each reports the engines' busy time, both
GPUs' idle shares and the step time over max(generation, training). With --compare-critic-placement
(2 GPUs) the runs are colocated on both GPUs, then actor + reference + engine on GPU 0 with the critic
alone on GPU 1 (trainer.placement.critic=[1]); the second reports the critic's busy time
(perf/critic_busy_s) against the actor's wait for it (timing_s/values + timing_s/update_critic).
With --compare-impl the runs are both colocated, every model on Transformer Engine's layers ("te"), then
on megatron-core's local ones ("local"; ``*.megatron.override_transformer_config.transformer_impl``):
the summary gives the training passes' speed-up; it needs Transformer Engine (launch/build_te.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = (
    "offload",
    "reshard",
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)
OFFLOAD_KEYS = [
    *(f"actor_rollout_ref.actor.megatron.{k}_offload" for k in ("param", "grad", "optimizer")),
    *(f"critic.megatron.{k}_offload" for k in ("param", "grad", "optimizer")),
    "actor_rollout_ref.ref.megatron.param_offload",
]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
MODELS = ("qwen2.5-1.5b", "qwen3-30b-a3b", "deepseek-v3", "tiny", "tiny-moe")
MOE_LAYERS = 4  # --layers of qwen3-30b-a3b by default


def model_shape(model: str, layers: int | None) -> tuple[str, dict]:
    """(architecture, HF config dims) of a --model; ``layers`` overrides num_hidden_layers."""
    from megatron_rl.models.random_hf import DEEPSEEK_V3, QWEN3_30B_A3B, QWEN25_1_5B, TINY, TINY_MOE

    arch, dims = {
        "qwen2.5-1.5b": ("qwen2", QWEN25_1_5B),
        "qwen3-30b-a3b": ("qwen3_moe", {**QWEN3_30B_A3B, "num_hidden_layers": MOE_LAYERS}),
        # DeepSeek-V3's widths (attention, expert and dense MLP, vocabulary), cut to one GPU: a dense
        # layer and an MoE layer of 16 routed experts (8 groups of 2, top-8 from 4 groups) + the shared one
        "deepseek-v3": (
            "deepseek_v3",
            {**DEEPSEEK_V3, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16},
        ),
        "tiny": ("qwen2", {**TINY, "vocab_size": 512}),
        "tiny-moe": ("qwen3_moe", {**TINY, **TINY_MOE["qwen3_moe"], "vocab_size": 512}),
    }[model]
    dims = dict(dims)
    if layers is not None:
        dims["num_hidden_layers"] = layers
    return arch, dims


def prepare(
    work: str, model: str, prompt_len: int, n_prompts: int, seed: int, layers: int | None = None
) -> tuple[str, str, str]:
    """Model directory, tokenizer directory and a training parquet file under ``work``.

    The tokenizer has its own directory: beside a Qwen2 config.json, transformers would load it as a
    Qwen2 tokenizer and replace its whitespace pre-tokenizer with Qwen2's byte-level one.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.models.random_hf import save_random_hf_model

    arch, dims = model_shape(model, layers)
    model_dir, tok_dir = os.path.join(work, "model"), os.path.join(work, "tokenizer")
    vocab = dims["vocab_size"]
    config_file = os.path.join(model_dir, "config.json")
    if os.path.isfile(config_file):  # a model saved by an earlier run under the same --out: reuse it
        with open(config_file) as f:
            saved = json.load(f)
        want = (arch, dims["num_hidden_layers"], dims["hidden_size"], vocab)
        have = tuple(saved.get(k) for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"))
        if have != want:
            raise SystemExit(
                f"bench: {model_dir} holds another model (model_type, layers, hidden, vocab = {have}, "
                f"--model {model} needs {want}); use another --out"
            )
    else:
        words = {f"t{i}": i for i in range(vocab - 3)}
        words.update({"<pad>": vocab - 3, "<s>": vocab - 2, "</s>": vocab - 1})
        tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE
        )
        hf_tok.save_pretrained(tok_dir)
        ids = dict(pad_token_id=vocab - 3, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
        # HF's default init (std 0.02): sane bf16 activations; the benchmark measures speed, not quality.
        save_random_hf_model(model_dir, arch, seed=seed, init="hf", dtype=torch.bfloat16, **dims, **ids)
    data = os.path.join(work, "train.parquet")
    rng = random.Random(seed)
    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": " ".join(f"t{rng.randrange(vocab - 3)}" for _ in range(prompt_len)),
                }
            ],
            "data_source": "bench/synthetic",
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
        }
        for i in range(n_prompts)
    ]
    pq.write_table(pa.Table.from_pylist(rows), data)
    return model_dir, tok_dir, data


def dynamic_keys(a: argparse.Namespace) -> dict:
    """use_dynamic_bsz with budgets of the fixed path's micro-batch sizes x the longest sequence: the
    updates and the values pass hold --micro sequences, the log-prob passes twice that."""
    longest = a.prompt_len + a.response_len
    micro, log_prob = a.micro * longest, a.micro * 2 * longest
    return {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": micro,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": log_prob,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": log_prob,
        "critic.ppo_max_token_len_per_gpu": micro,
        "critic.forward_max_token_len_per_gpu": micro,
    }


def packing(on: bool) -> dict:
    """``*.megatron.use_remove_padding`` of the trained models (the reference and reward models follow
    the actor)."""
    return {f"{m}.megatron.use_remove_padding": on for m in ("actor_rollout_ref.actor", "critic")}


def transformer_impl(impl: str) -> dict:
    """``*.megatron.override_transformer_config.transformer_impl`` of the actor, reference and critic."""
    models = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
    return {f"{m}.megatron.override_transformer_config.transformer_impl": impl for m in models}


def run(
    a: argparse.Namespace,
    model_dir: str,
    tok_dir: str,
    data: str,
    name: str,
    colocate: bool,
    dynamic: bool,
    extra: dict | None = None,
) -> tuple[list[dict], int]:
    out = os.path.join(a.out, name)
    overrides = {
        "data.train_files": f"[{data}]",
        "data.tokenizer": tok_dir,
        "data.max_prompt_length": a.prompt_len,
        "data.max_response_length": a.response_len,
        "data.train_batch_size": a.batch,
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.actor.ppo_mini_batch_size": a.batch,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": a.micro,
        "actor_rollout_ref.actor.use_kl_loss": True,  # keeps the reference model in the step
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": a.tp,
        "actor_rollout_ref.actor.megatron.params_dtype": "bfloat16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": a.micro * 2,
        "actor_rollout_ref.rollout.name": a.rollout,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": a.rollout_tp or a.tp,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": a.micro * 2,
        "actor_rollout_ref.rollout.free_cache_engine": colocate,
        "actor_rollout_ref.rollout.gpu_memory_utilization": a.gpu_memory_utilization,
        "actor_rollout_ref.rollout.enable_cuda_graph": a.cuda_graph,
        # colocated: every key on, or (--offload auto) the memory planner's choice
        **{k: (("auto" if a.offload == "auto" else True) if colocate else False) for k in OFFLOAD_KEYS},
        **{
            f"{m}.megatron.{key}": not off
            for m in ("actor_rollout_ref.actor", "critic")
            for key, off in (
                ("sequence_parallel", a.no_sequence_parallel),
                ("use_distributed_optimizer", a.no_distributed_optimizer),
            )
        },
        "critic.ppo_micro_batch_size_per_gpu": a.micro,
        "custom_reward_function.path": os.path.join(ROOT, "bench", "synthetic_reward.py"),
        "algorithm.adv_estimator": "gae",
        "trainer.total_training_steps": a.steps,
        "trainer.save_at_end": a.save,
        "trainer.test_freq": -1,
        "trainer.logger": "[console,jsonl]",
        "trainer.default_local_dir": out,
        "trainer.resume_mode": "disable",
        "trainer.device": a.device,
    }
    if dynamic:
        overrides.update(dynamic_keys(a))
    overrides.update(extra or {})
    overrides.update(kv.split("=", 1) for kv in a.set)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    if a.response_spread:
        cmd += [os.path.join(ROOT, "bench", "spread_train.py"), *map(str, a.response_spread)]
    else:
        cmd += ["-m", "megatron_rl.train"]
    cmd += [f"{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("MEGATRON_RL_JOB_SECRET", secrets.token_hex(32))  # as launch/torchrun.sh gives one
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    path = os.path.join(out, "logs", "metrics.jsonl")
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
    if rc:  # e.g. out of memory: the steps that finished still tell their story
        print(f"bench: the {os.path.basename(out)} run exited with status {rc} after {len(rows)} steps")
    return rows, rc


def summarize(rows: list[dict], nproc: int) -> dict:
    steady = rows[1:] or rows  # step 1 pays for compilation, CUDA-graph capture and allocator warm-up

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steady if key in r]
        return statistics.fmean(vals) if vals else None

    step = mean("timing_s/step")
    phases = {p: mean(f"timing_s/{p}") for p in PHASES}
    busy = sum(v for v in phases.values() if v)
    return {
        "steps_measured": len(steady),
        "step_s": step,
        "phases_s": phases,
        "other_s": step - busy if step else None,
        # Moving state around rather than computing: parking, the weight sync, and the untimed rest.
        "non_compute_fraction": (
            ((phases["offload"] or 0) + (phases["reshard"] or 0) + step - busy) / step if step else None
        ),
        "tokens_per_s_per_gpu": mean("perf/throughput"),
        "mfu_actor": mean("perf/mfu/actor"),
        "peak_tflops": mean("perf/peak_tflops"),
        "max_memory_allocated_gb": max(
            (r.get("perf/max_memory_allocated_gb", 0) for r in rows), default=None
        ),
        "max_memory_reserved_gb": max((r.get("perf/max_memory_reserved_gb", 0) for r in rows), default=None),
        "max_device_memory_used_gb": max(
            (r.get("perf/max_device_memory_used_gb", 0) for r in rows), default=None
        ),
        "optimizer_state_gb_per_gpu": mean("perf/optimizer_state_gb"),
        "parked_gb_per_gpu": mean("perf/parked_gb"),
        "response_length": mean("response_length/mean"),
        "padding_fraction": mean("perf/padding_fraction"),
        # old_log_prob + ref + values + both updates: the passes that micro-batching shapes
        "training_passes_s": sum(
            phases[p] or 0 for p in ("old_log_prob", "ref", "values", "update_critic", "update_actor")
        ),
        # rollout-training mismatch (actor_rollout_ref.rollout.calculate_log_probs=true)
        "mismatch": {
            k: mean(k)
            for k in (
                "training/rollout_probs_diff_mean",
                "training/rollout_probs_diff_max",
                "training/rollout_probs_diff_std",
                "rollout_corr/kl",
                "rollout_corr/k3_kl",
                "rollout_corr/log_ppl_abs_diff",
                "rollout_corr/rollout_is_mean",
                "rollout_corr/rollout_rs_masked_fraction",
                "rollout_corr/chi2_token",
                "rollout_corr/chi2_seq",
                "rollout_corr/router_mismatch",
                "actor/router_mismatch",
                "actor/ppo_kl",
            )
            if mean(k) is not None
        },
        # MoE routers over the actor's update: expert load (max / mean tokens per expert), aux losses
        "moe": {
            k: mean(k)
            for k in ("actor/moe_load_imbalance", "actor/moe_aux_loss", "actor/moe_z_loss")
            if mean(k) is not None
        },
        # placement: the engines' own time, and each side's idle share of the step
        "engine_busy_s": mean("perf/rollout_engine_busy_s"),
        "train_gpu_idle_fraction": (
            (phases["gen"] or 0) / step if step and mean("perf/rollout_engine_busy_s") else None
        ),
        "rollout_gpu_idle_fraction": (
            1 - mean("perf/rollout_engine_busy_s") / step
            if step and mean("perf/rollout_engine_busy_s")
            else None
        ),
        # step over max(generation, training): 1.0 is perfect overlap
        "step_vs_max_gen_train": (
            step / max(mean("perf/rollout_engine_busy_s"), step - (phases["gen"] or 0))
            if step and mean("perf/rollout_engine_busy_s")
            else None
        ),
        "staleness_mean": mean("rollout/staleness/mean"),
        # a critic on its own ranks: its compute, and how much of it the actor waited for
        "critic_busy_s": mean("perf/critic_busy_s"),
        "critic_wait_s": (
            (phases["values"] or 0) + (phases["update_critic"] or 0) if mean("perf/critic_busy_s") else None
        ),
        "nproc": nproc,
    }


def add_model_args(ap: argparse.ArgumentParser, models: tuple[str, ...] = MODELS) -> None:
    """--model (one of ``models``) and --layers, as every benchmark of a model shape takes them."""
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=models)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"decoder layers (default: {MOE_LAYERS} for qwen3-30b-a3b, the shape's own for the others)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=None)
    ap.add_argument("--rollout", default="sglang", choices=["sglang", "hf"])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="prompts per step (n=1)")
    ap.add_argument("--micro", type=int, default=8, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--no-sequence-parallel", action="store_true", help="TP > 1 without sequence parallelism")
    ap.add_argument(
        "--no-distributed-optimizer", action="store_true", help="DP > 1 with replicated optimizer states"
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument(
        "--no-cuda-graph", dest="cuda_graph", action="store_false", help="SGLang without decode CUDA graphs"
    )
    ap.add_argument("--no-compare", action="store_true", help="skip the non-colocated run")
    ap.add_argument(
        "--offload",
        default="auto",
        choices=["on", "auto"],
        help="colocated runs: auto (the default: park only what does not fit) or every *_offload key on",
    )
    ap.add_argument(
        "--only",
        choices=[
            "colocated",
            "separate",
            "padded",
            "dynamic",
            "packed",
            "placed_s0",
            "placed_s1",
            "critic_placed",
            "te",
            "local",
        ],
        help="run one of the two configurations",
    )
    ap.add_argument("--save", action="store_true", help="save a checkpoint after the last step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--response-spread",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        help="response lengths uniform in [LO, HI]",
    )
    ap.add_argument(
        "--compare-dynamic", action="store_true", help="colocated runs: padded, then use_dynamic_bsz"
    )
    ap.add_argument(
        "--compare-packed",
        action="store_true",
        help="colocated runs with use_dynamic_bsz: padded rows, then packed (use_remove_padding)",
    )
    ap.add_argument(
        "--compare-placement",
        action="store_true",
        help="--nproc 2: colocated on both GPUs, then actor+critic on GPU 0 and the engine on GPU 1 "
        "at max_staleness 0 and 1",
    )
    ap.add_argument(
        "--compare-critic-placement",
        action="store_true",
        help="--nproc 2: colocated on both GPUs, then the critic alone on GPU 1",
    )
    ap.add_argument(
        "--compare-impl",
        action="store_true",
        help="colocated runs on Transformer Engine's layers, then on megatron-core's local ones",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other trainer key (repeatable)"
    )
    a = ap.parse_args()
    if a.response_spread and a.rollout != "sglang":
        ap.error("--response-spread sets each SGLang request's length: it needs --rollout sglang")

    os.makedirs(a.out, exist_ok=True)
    model_dir, tok_dir, data = prepare(
        os.path.join(a.out, "inputs"), a.model, a.prompt_len, a.batch * a.steps, a.seed, a.layers
    )
    result = {"args": vars(a)}
    placed = {
        "trainer.placement.rollout": f"[{a.nproc - 1}]",
        "actor_rollout_ref.rollout.free_cache_engine": False,  # the engine has its GPU to itself
        **{k: False for k in OFFLOAD_KEYS},
    }
    extra = {
        "placed_s0": {**placed, "actor_rollout_ref.rollout.max_staleness": 0},
        "placed_s1": {**placed, "actor_rollout_ref.rollout.max_staleness": 1},
        "critic_placed": {"trainer.placement.critic": f"[{a.nproc - 1}]"},
        **{name: packing(False) for name in ("padded", "dynamic")},
        "packed": packing(True),
        "te": transformer_impl("transformer_engine"),
        "local": transformer_impl("local"),
    }
    if a.compare_placement:
        if a.nproc != 2 or a.tp != 1:
            ap.error("--compare-placement runs on 2 GPUs at --tp 1 (the actor alone on GPU 0)")
        runs = (("colocated", True, False), ("placed_s0", True, False), ("placed_s1", True, False))
    elif a.compare_critic_placement:
        if a.nproc != 2 or a.tp != 1:
            ap.error("--compare-critic-placement runs on 2 GPUs at --tp 1 (the critic alone on GPU 1)")
        runs = (("colocated", True, False), ("critic_placed", True, False))
    elif a.compare_dynamic:
        runs = (("padded", True, False), ("dynamic", True, True))
    elif a.compare_packed:
        runs = (("dynamic", True, True), ("packed", True, True))
    elif a.compare_impl:
        runs = (("te", True, False), ("local", True, False))
    else:
        runs = (("colocated", True, False), ("separate", False, False))[: 1 if a.no_compare else 2]
    for name, colocate, dynamic in [r for r in runs if a.only in (None, r[0])]:
        rows, rc = run(a, model_dir, tok_dir, data, name, colocate, dynamic, extra.get(name))
        result[name] = summarize(rows, a.nproc) if rows else {}
        if rc:
            result[name]["error"] = (
                f"the trainer exited with status {rc} after {len(rows)} of {a.steps} steps"
            )
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
    key = "max_device_memory_used_gb"
    co, sep = (result.get(n, {}).get(key) for n in ("colocated", "separate"))
    result["peak_memory_ratio_colocated_vs_separate"] = co / sep if co and sep else None
    padded, dyn, packed = (
        result.get(n, {}).get("training_passes_s") for n in ("padded", "dynamic", "packed")
    )
    result["training_passes_speedup_dynamic_vs_padded"] = padded / dyn if padded and dyn else None
    result["training_passes_speedup_packed_vs_dynamic"] = dyn / packed if dyn and packed else None
    te, local = (result.get(n, {}).get("training_passes_s") for n in ("te", "local"))
    result["training_passes_speedup_te_vs_local"] = local / te if te and local else None
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if any("error" in result.get(n, {}) for n, *_ in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
