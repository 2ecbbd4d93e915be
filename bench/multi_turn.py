"""Benchmark: multi-turn rollouts against single-turn generation of the same model token count, with
tool latencies and episode lengths as agent workloads have them, per-episode (async) and batch-synchronous
(lockstep) turn schedules side by side.

    python bench/multi_turn.py --model qwen2.5-1.5b --rollout sglang --out bench_out/multi_turn
    python bench/multi_turn.py --model tiny --device cpu --rollout hf --batch 16 --steps 3 --out /tmp/mt

The model, tokenizer and prompts are bench/ppo_step.py's (a random HF model, a word-level tokenizer,
prompts of exactly --prompt-len tokens); every prompt row names the simulated user
(bench/synthetic_interaction.py), which stands for the tools. Colocated PPO runs of ``megatron_rl.train``:

- ``single``: one model turn of --response-len tokens per episode;
- ``multi``: 3 model turns of --response-len / 3 tokens each (multi_turn.max_tokens_per_turn), between
  them 2 fixed replies of --reply-len tokens, answered at once;
- ``latency``: the same with every reply after a latency drawn from a log-normal distribution (median
  --latency-median-s, 99th percentile --latency-p99-s, seeded per row and reply);
- ``tail``: ``latency`` with a long-tail mix: --tail-share of the episodes (seeded) run --tail-factor
  times the median's turns (and tokens);
- each multi-turn run also as ``<name>_lockstep`` (multi_turn.schedule=lockstep: every turn waits for
  every episode's, the batch-synchronous schedule);
- ``tail_partial``: ``tail`` with partial rollouts (rollout.partial_rollout, max_staleness
  --max-staleness): a step trains on the first batch of prompts whose episodes ended, the others go on
  into the next step.

Reported per run (steps after the first): timing_s/gen and the step's seconds, the engine's model tokens
per step (replies not counted) and their tokens/s, multi_turn/engine_busy_ratio (seconds with a turn in
the engine over the rollout's), multi_turn/prefix_cache_hit_ratio (SGLang: context tokens its radix
cache held), the median and longest episode's seconds, the step and generation time over the
median episode's, and the staleness of the trained sequences (rollout/staleness/*: 0 but with partial
rollouts). Ratios: multi / single tokens/s (goal >= 0.9), latency / multi generation time (goal <= 1.1),
tail_partial / latency step time (goal <= 1.3; tail / latency without partial rollouts), async /
lockstep per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ppo_step import prepare, run, summarize  # noqa: E402

INTERACTION = "synthetic"
TURNS = 3
RUNS = (
    "single",
    "multi",
    "multi_lockstep",
    "latency",
    "latency_lockstep",
    "tail",
    "tail_lockstep",
    "tail_partial",
)


def add_interaction(data: str, out_path: str, tail_share: float, tail_factor: int, seed: int) -> str:
    """``data`` with ``extra_info.interaction_kwargs = {name, row, replies}`` on every row: a seeded
    ``tail_share`` of the rows answers ``tail_factor`` times the median's turns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(data).to_pylist()
    rng = random.Random(seed)
    for k, r in enumerate(rows):
        turns = TURNS * tail_factor if rng.random() < tail_share else TURNS
        kw = {"name": INTERACTION, "row": k, "replies": turns - 1}
        r["extra_info"] = {**(r.get("extra_info") or {}), "interaction_kwargs": kw}
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return out_path


def write_interaction_yaml(path: str, reply: str, median_s: float, p99_s: float, seed: int) -> str:
    """verl's interaction config naming bench.synthetic_interaction.SyntheticInteraction."""
    config = {
        "reply": reply,
        "replies": TURNS - 1,
        "latency_median_s": median_s,
        "latency_p99_s": p99_s,
        "seed": seed,
    }
    with open(path, "w") as f:
        f.write("interaction:\n")
        f.write(f"  - name: {INTERACTION}\n")
        f.write("    class_name: bench.synthetic_interaction.SyntheticInteraction\n")
        f.write(f"    config: {json.dumps(config)}\n")  # JSON is YAML
    return path


def measure(rows: list[dict], a: argparse.Namespace) -> dict:
    """One run's numbers over the steps after the first (the first pays for compilation and warm-up)."""
    s = summarize(rows, a.nproc)
    steady = rows[1:] or rows

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steady if key in r]
        return statistics.fmean(vals) if vals else None

    gen, step = s["phases_s"]["gen"], s["step_s"]
    # multi-turn: what the engine returned; single-turn: the whole response is the model's
    tokens = mean("multi_turn/model_tokens") or a.batch * (s["response_length"] or 0)
    median_ep = mean("multi_turn/episode_s/median")
    return {
        "steps_measured": s["steps_measured"],
        "gen_s": gen,
        "step_s": step,
        "response_length_mean": s["response_length"],
        "model_tokens_per_step": tokens,
        "tokens_per_s": tokens / gen if gen else None,
        "episodes_per_s": a.batch / gen if gen else None,
        "num_turns_mean": mean("multi_turn/num_turns/mean"),
        "num_turns_max": mean("multi_turn/num_turns/max"),
        "length_ended_ratio": mean("multi_turn/length_ended_ratio"),
        "engine_busy_ratio": mean("multi_turn/engine_busy_ratio"),
        "prefix_cache_hit_ratio": mean("multi_turn/prefix_cache_hit_ratio"),
        "episode_s_median": median_ep,
        "episode_s_max": mean("multi_turn/episode_s/max"),
        "gen_over_median_episode": gen / median_ep if gen and median_ep else None,
        "step_over_median_episode": step / median_ep if step and median_ep else None,
        # partial rollouts: policy versions between the sampling and the trained actor (0 without)
        "staleness_mean": mean("rollout/staleness/mean") or 0.0,
        "staleness_max": max((r.get("rollout/staleness/max", 0.0) for r in steady), default=0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=["qwen2.5-1.5b", "tiny"])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--rollout", default="sglang", choices=["sglang", "hf"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="prompts per step (n=1)")
    ap.add_argument("--micro", type=int, default=8, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 512 (tiny: 64)")
    ap.add_argument(
        "--response-len",
        type=int,
        default=None,
        help="model tokens of a median episode, 3 turns of a third each; default 768 (tiny: 96)",
    )
    ap.add_argument("--reply-len", type=int, default=16, help="tokens of each user reply (masked)")
    ap.add_argument("--latency-median-s", type=float, default=0.1, help="the replies' median latency")
    ap.add_argument("--latency-p99-s", type=float, default=2.0, help="the replies' 99th-percentile latency")
    ap.add_argument("--tail-share", type=float, default=0.05, help="share of long episodes in the tail run")
    ap.add_argument("--tail-factor", type=int, default=8, help="their turns over the median episode's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument(
        "--no-cuda-graph", dest="cuda_graph", action="store_false", help="SGLang without decode CUDA graphs"
    )
    ap.add_argument(
        "--offload",
        default="auto",
        choices=["on", "auto"],
        help="auto (the default: park only what does not fit) or every *_offload key on",
    )
    ap.add_argument("--only", default=",".join(RUNS), help=f"comma-separated runs of {', '.join(RUNS)}")
    ap.add_argument("--max-staleness", type=int, default=1, help="tail_partial: rollout.max_staleness")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other trainer key (repeatable)"
    )
    a = ap.parse_args()
    only = [x for x in a.only.split(",") if x]
    if bad := [x for x in only if x not in RUNS]:
        ap.error(f"--only: unknown runs {bad}; choose from {', '.join(RUNS)}")
    tiny = a.model == "tiny"
    a.prompt_len = a.prompt_len or (64 if tiny else 512)
    a.response_len = a.response_len or (96 if tiny else 768)
    if a.response_len % TURNS:
        ap.error(f"--response-len={a.response_len} must be a multiple of {TURNS} (tokens per model turn)")
    # what bench/ppo_step.run reads and this benchmark does not vary
    a.no_sequence_parallel = a.no_distributed_optimizer = a.save = False
    a.response_spread = None

    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    inputs = os.path.join(a.out, "inputs")
    # one batch more than the steps: partial rollouts keep two batches in flight from the first step
    model_dir, tok_dir, data = prepare(inputs, a.model, a.prompt_len, a.batch * (a.steps + 1), a.seed)
    mt_data = add_interaction(data, os.path.join(inputs, "train_multi_turn.parquet"), 0.0, 1, a.seed)
    tail_data = add_interaction(
        data, os.path.join(inputs, "train_tail.parquet"), a.tail_share, a.tail_factor, a.seed
    )
    turn = a.response_len // TURNS
    reply = " ".join(f"t{i}" for i in range(a.reply_len))  # a.reply_len tokens of the word-level vocab

    def budget(turns: int) -> int:  # every turn and reply fits: no episode ends by the budget
        return turns * turn + (turns - 1) * a.reply_len + 1

    result: dict = {"args": vars(a), "turn_tokens": turn}
    for name in RUNS:
        if name not in only:
            continue
        base = name.removesuffix("_lockstep").removesuffix("_partial")
        extra: dict = {}
        rows_data = data
        if base != "single":
            median_s = a.latency_median_s if base in ("latency", "tail") else 0.0
            cfg_path = write_interaction_yaml(
                os.path.join(a.out, f"{name}_interaction.yaml"), reply, median_s, a.latency_p99_s, a.seed
            )
            turns = TURNS * (a.tail_factor if base == "tail" else 1)
            mt = "actor_rollout_ref.rollout.multi_turn"
            extra = {
                f"{mt}.enable": True,
                f"{mt}.interaction_config_path": cfg_path,
                f"{mt}.max_assistant_turns": turns,
                f"{mt}.max_tokens_per_turn": turn,
                f"{mt}.schedule": "lockstep" if name.endswith("_lockstep") else "async",
                "data.max_response_length": budget(turns),
            }
            if name.endswith("_partial"):
                extra |= {
                    "actor_rollout_ref.rollout.partial_rollout": True,
                    "actor_rollout_ref.rollout.max_staleness": a.max_staleness,
                }
            rows_data = tail_data if base == "tail" else mt_data
        rows, rc = run(a, model_dir, tok_dir, rows_data, name, True, False, extra)
        result[name] = measure(rows, a) if rows else {}
        if rc:
            result[name]["error"] = f"the trainer exited with {rc} after {len(rows)} of {a.steps} steps"
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)

    def ratio(num: str, den: str, key: str) -> float | None:
        x, y = (result.get(n, {}).get(key) for n in (num, den))
        return x / y if x and y else None

    result["multi_vs_single_tokens_per_s"] = ratio("multi", "single", "tokens_per_s")  # goal >= 0.9
    result["latency_vs_multi_gen_s"] = ratio("latency", "multi", "gen_s")  # goal <= 1.1
    result["tail_vs_latency_step_s"] = ratio("tail", "latency", "step_s")
    result["tail_partial_vs_latency_step_s"] = ratio("tail_partial", "latency", "step_s")  # goal <= 1.3
    for base in ("multi", "latency", "tail"):
        result[f"{base}_async_vs_lockstep_gen_s"] = ratio(base, f"{base}_lockstep", "gen_s")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if any("error" in result.get(n, {}) for n in RUNS):
        sys.exit(1)


if __name__ == "__main__":
    main()
