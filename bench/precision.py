"""Benchmark: learning and training-inference mismatch per precision, on the toy demo at an RL-sized LR.

    python bench/precision.py --out bench_out/precision                      # one GPU, SGLang engine
    python bench/precision.py --out bench_out/precision --engine hf          # transformers engine

Each variant runs ``torchrun -m megatron_rl.train --config yaml/cpu_demo.yaml`` unchanged but for the
keys below (same model, data, seeds and LR), with the engine's log-probs returned
(``rollout.calculate_log_probs``) so that every step logs the mismatch between the engine and the
trainer (``rollout_corr/*``, ``training/rollout_probs_diff_*``). The summary holds every validation
score, the reward curve, ``actor/param_update_frac`` (the share of low-precision parameter elements an
update actually changed) and the mismatch means over the run. The trainer runs fp32 on CPU whatever
the dtype keys say: this comparison needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: (params dtype, engine dtype, stochastic rounding)
    "fp32_params_bf16_engine": ("float32", "bfloat16", False),
    "bf16_nearest": ("bfloat16", "bfloat16", False),
    "bf16_stochastic": ("bfloat16", "bfloat16", True),  # the shipped default
    "fp16": ("float16", "float16", False),
}
MISMATCH = (
    "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/chi2_token",
    "training/rollout_probs_diff_mean",
)


def run(a: argparse.Namespace, name: str, data: dict[str, str]) -> list[dict]:
    dtype, engine_dtype, sr = VARIANTS[name]
    out = os.path.join(a.out, name)
    overrides = {
        "data.train_files": f"[{data['train']}]",
        "data.val_files": f"[{data['test']}]",
        "actor_rollout_ref.model.path": data["model"],
        "actor_rollout_ref.actor.optim.lr": a.lr,
        "critic.optim.lr": a.lr,
        "actor_rollout_ref.actor.optim.stochastic_rounding": sr,
        "critic.optim.stochastic_rounding": sr,
        "actor_rollout_ref.actor.megatron.params_dtype": dtype,
        "actor_rollout_ref.rollout.dtype": engine_dtype,
        "critic.megatron.params_dtype": dtype,
        "actor_rollout_ref.rollout.name": a.engine,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": a.tp,
        "actor_rollout_ref.rollout.n": a.n,
        "trainer.total_training_steps": a.steps,
        "trainer.test_freq": a.test_freq,
        "trainer.save_at_end": False,
        "trainer.device": a.device,
        "trainer.default_local_dir": out,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    cmd += ["-m", "megatron_rl.train", "--config", os.path.join(ROOT, "yaml", "cpu_demo.yaml")]
    cmd += [f"{k}={v}" for k, v in overrides.items()] + a.override
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}, see {out}/train.log")
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict]) -> dict:
    step = "training/global_step"
    val = {r.get(step, 0): v for r in rows for k, v in r.items() if k.startswith("val-core/")}
    return {
        "val": val,
        "score_mean": [r["critic/score/mean"] for r in rows if "critic/score/mean" in r],
        "param_update_frac": [r["actor/param_update_frac"] for r in rows if "actor/param_update_frac" in r],
        "mismatch_mean": {k: _mean([r[k] for r in rows if k in r]) for k in MISMATCH},
        "step_s": _mean([r["timing_s/step"] for r in rows[2:] if "timing_s/step" in r]),
        "loss_scale_skips": sum(r.get("actor/loss_scale_skips", 0) for r in rows),
        "nonfinite_grad_steps": sum(r.get("actor/nonfinite_grad_steps", 0) for r in rows),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test only")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--engine", default="sglang", choices=["sglang", "hf"])
    ap.add_argument("--lr", type=float, default=3e-5, help="actor and critic LR")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n", type=int, default=2, help="rollout.n (the published figures used 2)")
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--override", nargs="*", default=[], help="more KEY=VALUE config overrides")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from megatron_rl.demo import prepare

    data = prepare(os.path.join(a.out, "demo"))
    result = {"args": vars(a)}
    for name in a.variants:
        try:
            result[name] = summarize(run(a, name, data))
        except RuntimeError as e:  # one variant's failure is a result too; the others still run
            result[name] = {"error": str(e)}
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v["val"] if isinstance(v, dict) and "val" in v else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
