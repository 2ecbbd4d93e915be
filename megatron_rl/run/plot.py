"""Plot a run: ``python -m megatron_rl.run.plot RUN_DIR [--out file.png]``.

Reads RUN_DIR/metrics.jsonl (or RUN_DIR/logs/metrics.jsonl: every run writes it to trainer.log_dir)
and draws reward, KL, losses and response length against the step. Needs matplotlib
(``pip install matplotlib``, or ``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import argparse
import json
import os

PANELS = (
    ("reward", ("critic/score/mean", "val-core/*")),
    ("KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    ("losses", ("actor/pg_loss", "critic/vf_loss")),
    ("response length", ("response_length/mean",)),
)


def find_metrics(run_dir: str) -> str:
    for cand in (os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "logs", "metrics.jsonl")):
        if os.path.isfile(cand):
            return cand
    raise FileNotFoundError(
        f"no metrics.jsonl in {run_dir} or {run_dir}/logs: give the run's trainer.log_dir "
        "(default trainer.default_local_dir/logs); a run writes it from its first step on"
    )


def plot(run_dir: str, out: str | None = None) -> str:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "megatron-rl: plotting needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[plot]' in a checkout)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(find_metrics(run_dir)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            names = {k for r in rows for k in r if k == key or (key.endswith("*") and k.startswith(key[:-1]))}
            for name in sorted(names):
                pts = [(r["step"], r[name]) for r in rows if name in r]
                ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) < 10 else None, ms=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        print(plot(a.run_dir, a.out))
    except FileNotFoundError as e:
        raise SystemExit(f"megatron-rl: {e}") from None


if __name__ == "__main__":
    main()
