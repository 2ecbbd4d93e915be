"""Benchmark: multi-turn rollouts against single-turn generation of the same model token count.

    python bench/multi_turn.py --model qwen2.5-1.5b --rollout sglang --out bench_out/multi_turn
    python bench/multi_turn.py --model tiny --device cpu --rollout hf --batch 8 --steps 2 --out /tmp/mt

The model, tokenizer and prompts are bench/ppo_step.py's (a random HF model, a word-level tokenizer,
prompts of exactly --prompt-len tokens); every prompt row also names the simulated user
(``extra_info.interaction_kwargs.name``). Three colocated PPO runs of ``megatron_rl.train``:

- ``single``: one model turn of --response-len tokens per episode (the 1.5B shape practically never
  samples EOS; the tiny one, of 512 words, does: its turns end early and the token counts differ);
- ``multi``: 3 model turns of --response-len / 3 tokens each, between them 2 fixed user replies of
  --reply-len tokens (bench/synthetic_interaction.py) answered at once;
- ``multi_delay``: the same with every reply after --delay-s seconds (a tool's latency).

The agent loop has no per-turn token cap (a turn may spend the whole data.max_response_length left),
so the interaction caps each model turn at --response-len / 3 tokens (TurnCappedEngine), and
multi_turn.max_assistant_turns = 3 ends the episode after its third turn. data.max_response_length is
3 turns + 2 replies + 1 token, so no episode ends by the budget.

Reported per run (steps after the first): timing_s/gen, model tokens per step (the replies' tokens
are not counted), tokens/s and episodes/s of generation, multi_turn/num_turns/mean (verl's count:
6 for 3 model turns and 2 replies), and for the multi-turn runs the agent loop's seconds outside the
engine as a share of it (waiting on the user/tools, plus the loop's own work). Ratios:
multi / single tokens/s (goal >= 0.8) and multi_delay / multi generation time (goal <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ppo_step import prepare, run, summarize  # noqa: E402

INTERACTION = "synthetic"
TURNS = 3


def add_interaction(data: str, out_path: str) -> str:
    """``data`` with ``extra_info.interaction_kwargs = {"name": INTERACTION}`` on every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(data).to_pylist()
    for r in rows:
        r["extra_info"] = {**(r.get("extra_info") or {}), "interaction_kwargs": {"name": INTERACTION}}
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return out_path


def write_interaction_yaml(path: str, reply: str, delay_s: float, turn_tokens: int, timing_path: str) -> str:
    """verl's interaction config naming bench.synthetic_interaction.SyntheticInteraction."""
    config = {
        "reply": reply,
        "replies": TURNS - 1,
        "delay_s": delay_s,
        "turn_tokens": turn_tokens,
        "timing_path": timing_path,
    }
    with open(path, "w") as f:
        f.write("interaction:\n")
        f.write(f"  - name: {INTERACTION}\n")
        f.write("    class_name: bench.synthetic_interaction.SyntheticInteraction\n")
        f.write(f"    config: {json.dumps(config)}\n")  # JSON is YAML
    return path


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measure(rows: list[dict], timing: list[dict], a: argparse.Namespace) -> dict:
    """One run's numbers over the steps after the first (the first pays for compilation and warm-up)."""
    s = summarize(rows, a.nproc)
    steady = rows[1:] or rows

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steady if key in r]
        return statistics.fmean(vals) if vals else None

    gen = s["phases_s"]["gen"]
    loop = timing[1:] or timing
    # multi-turn: what the engine returned; single-turn: the whole response is the model's
    tokens = (
        statistics.fmean(t["model_tokens"] for t in loop) if loop else a.batch * (s["response_length"] or 0)
    )
    out = {
        "steps_measured": s["steps_measured"],
        "gen_s": gen,
        "step_s": s["step_s"],
        "response_length_mean": s["response_length"],
        "model_tokens_per_step": tokens,
        "tokens_per_s": tokens / gen if gen else None,
        "episodes_per_s": a.batch / gen if gen else None,
        "num_turns_mean": mean("multi_turn/num_turns/mean"),
        "length_ended_ratio": mean("multi_turn/length_ended_ratio"),
    }
    if loop:
        run_s = statistics.fmean(t["run_s"] for t in loop)
        engine_s = statistics.fmean(t["engine_s"] for t in loop)
        out.update(
            agent_loop_s=run_s,
            engine_s=engine_s,
            engine_calls=statistics.fmean(t["engine_calls"] for t in loop),
            # the loop's time outside engine.generate: the user's/tools' answers and the loop's own work
            wait_share_of_loop=(run_s - engine_s) / run_s if run_s else None,
            wait_share_of_gen=(run_s - engine_s) / gen if gen else None,
        )
    return out


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
        help="model tokens per episode, 3 turns of a third each; default 768 (tiny: 96)",
    )
    ap.add_argument("--reply-len", type=int, default=16, help="tokens of each user reply (masked)")
    ap.add_argument("--delay-s", type=float, default=0.05, help="the multi_delay run's wait per reply")
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
    ap.add_argument("--only", choices=["single", "multi", "multi_delay"], help="run one configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other trainer key (repeatable)"
    )
    a = ap.parse_args()
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
    model_dir, tok_dir, data = prepare(inputs, a.model, a.prompt_len, a.batch * a.steps, a.seed)
    mt_data = add_interaction(data, os.path.join(inputs, "train_multi_turn.parquet"))
    turn = a.response_len // TURNS
    reply = " ".join(f"t{i}" for i in range(a.reply_len))  # a.reply_len tokens of the word-level vocab
    budget = a.response_len + (TURNS - 1) * a.reply_len + 1

    result: dict = {"args": vars(a), "turn_tokens": turn, "multi_turn_max_response_length": budget}
    for name, delay in (("single", None), ("multi", 0.0), ("multi_delay", a.delay_s)):
        if a.only not in (None, name):
            continue
        timing_path = os.path.join(a.out, name, "agent_loop_timing.jsonl")
        extra: dict = {}
        rows_data = data
        if delay is not None:
            os.makedirs(os.path.dirname(timing_path), exist_ok=True)
            if os.path.exists(timing_path):
                os.remove(timing_path)
            cfg_path = write_interaction_yaml(
                os.path.join(a.out, f"{name}_interaction.yaml"), reply, delay, turn, timing_path
            )
            mt = "actor_rollout_ref.rollout.multi_turn"
            extra = {
                f"{mt}.enable": True,
                f"{mt}.interaction_config_path": cfg_path,
                f"{mt}.max_assistant_turns": TURNS,
                "data.max_response_length": budget,
            }
            rows_data = mt_data
        rows, rc = run(a, model_dir, tok_dir, rows_data, name, True, False, extra)
        result[name] = measure(rows, read_jsonl(timing_path), a) if rows else {}
        if rc:
            result[name]["error"] = (
                f"the trainer exited with status {rc} after {len(rows)} of {a.steps} steps"
            )
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)

    def ratio(num: str, den: str, key: str) -> float | None:
        x, y = (result.get(n, {}).get(key) for n in (num, den))
        return x / y if x and y else None

    result["multi_vs_single_tokens_per_s"] = ratio("multi", "single", "tokens_per_s")  # goal >= 0.8
    result["multi_delay_vs_multi_gen_s"] = ratio("multi_delay", "multi", "gen_s")  # goal <= 1.10
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if any("error" in result.get(n, {}) for n in ("single", "multi", "multi_delay")):
        sys.exit(1)


if __name__ == "__main__":
    main()
