"""Step metrics with verl's names, phase timers, and the logger sinks (console, JSONL, TensorBoard, W&B).

Every rank computes the same scalars (they are reduced over data-parallel ranks first); rank 0
writes them. Console lines are grouped policy -> critic -> reward -> response -> timing -> perf.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch


class Timer:
    """``with timer("gen"): ...`` accumulates seconds under timing_s/gen."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}
        self.max_device_used = 0
        """Most device memory in use (all allocators, the rollout engine's included) at a phase end."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        # Phases end with device work in flight; synchronise so the time lands in the right phase.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            if not any("[megatron-rl phase" in n for n in getattr(e, "__notes__", ())):
                e.add_note(f"[megatron-rl phase {name}]")  # innermost phase: named in the error line
            raise
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                self.max_device_used = max(self.max_device_used, total - free)

    def add(self, name: str, seconds: float) -> None:
        """Seconds measured inside another phase (a share of it, e.g. reshard_check of reshard)."""
        self.times[name] = self.times.get(name, 0.0) + seconds

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out


def _reduced_stats(named: list[tuple[str, torch.Tensor]], group) -> dict[str, float]:
    """{name}/mean, /max, /min of each 1-D tensor over all data-parallel ranks.

    Every statistic travels in two all-reduces (sums and counts; max and -min) and reaches the host
    in one copy, whatever the number of metrics.
    """
    device = named[0][1].device
    sums, extremes = [], []
    for _, x in named:
        x = x.double().flatten()
        sums += [x.sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=device)]
        if x.numel():
            extremes += [x.max(), -x.min()]
        else:  # an empty shard must not win the max or the min
            extremes += [torch.tensor(-1e30, dtype=torch.float64, device=device)] * 2
    s, e = torch.stack(sums), torch.stack(extremes)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(s, group=group)
        dist.all_reduce(e, op=dist.ReduceOp.MAX, group=group)
    pairs, extreme_pairs = s.view(-1, 2).tolist(), e.view(-1, 2).tolist()
    out: dict[str, float] = {}
    for (name, _), (total, count), (mx, neg_mn) in zip(named, pairs, extreme_pairs, strict=True):
        out[f"{name}/mean"] = total / max(count, 1.0)
        out[f"{name}/max"] = mx
        out[f"{name}/min"] = -neg_mn
    return out


def _num_turns(batch: RolloutBatch) -> torch.Tensor:
    """[B] turns per sequence: extra_info["num_turns"] of a multi-turn episode, else 1."""
    turns = [(m.extra_info or {}).get("num_turns", 1) for m in batch.meta]
    return torch.tensor(turns, dtype=torch.float64)


def _set(field: torch.Tensor | None, name: str) -> torch.Tensor:
    """A field of the step's batch that data_metrics reads: set by the step before it is called."""
    if field is None:
        raise ValueError(f"data_metrics: batch.{name} is not set (compute it before the metrics)")
    return field


def data_metrics(
    batch: RolloutBatch, max_prompt_length: int, max_response_length: int, dp_group
) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values, response_length,
    prompt_length (each /mean, /max, /min, lengths with /clip_ratio: the share at the data.max_*_length
    limit), response/aborted_ratio (empty responses), response_length_non_aborted/* (the lengths of the
    others), training/num_turns/* (the episode's turns, as multi_turn/num_turns/*; 1 for a single-turn
    rollout), critic/vf_explained_var.

    ``critic/vf_explained_var`` is 1 - Var[returns - values] / Var[returns] over the response tokens
    of all data-parallel ranks (its moments ride along as five more "mean" statistics).
    """
    scores = _set(batch.token_level_scores, "token_level_scores")
    rewards = _set(batch.token_level_rewards, "token_level_rewards")
    advantages, returns = _set(batch.advantages, "advantages"), _set(batch.returns, "returns")
    keep = batch.response_mask.bool()  # the tokens trained on (rollout rejection may have removed some)
    p = batch.prompts.shape[1]
    resp_len = batch.attention_mask[:, p:].sum(-1).double()
    prompt_len = batch.attention_mask[:, :p].sum(-1).double()
    named = [
        ("critic/score", scores.sum(-1)),
        ("critic/rewards", rewards.sum(-1)),
        ("critic/advantages", advantages[keep]),
        ("critic/returns", returns[keep]),
        ("response_length", resp_len),
        ("response_length/clip", (resp_len >= max_response_length).double()),
        ("prompt_length", prompt_len),
        ("prompt_length/clip", (prompt_len >= max_prompt_length).double()),
        ("response/aborted", (resp_len == 0).double()),
        # verl's response_length_non_aborted/*: the lengths without the empty (aborted) responses
        ("response_length_non_aborted", resp_len[resp_len > 0]),
        ("response_length_non_aborted/clip", (resp_len[resp_len > 0] >= max_response_length).double()),
        ("training/num_turns", _num_turns(batch).to(resp_len)),
    ]
    if batch.values is not None:
        ret, res = returns[keep].double(), (returns - batch.values)[keep].double()
        named += [("critic/values", batch.values[keep])]
        named += [(f"ev/{k}", v) for k, v in (("r", ret), ("r2", ret * ret), ("e", res), ("e2", res * res))]
    stats = _reduced_stats(named, dp_group)
    out = {
        k: v
        for k, v in stats.items()
        if not k.startswith(
            (
                "ev/",
                "response_length/clip/",
                "prompt_length/clip/",
                "response/",
                "response_length_non_aborted/clip/",
            )
        )
    }
    out["response_length_non_aborted/clip_ratio"] = stats["response_length_non_aborted/clip/mean"]
    out["response_length/clip_ratio"] = stats["response_length/clip/mean"]
    out["prompt_length/clip_ratio"] = stats["prompt_length/clip/mean"]
    out["response/aborted_ratio"] = stats["response/aborted/mean"]
    if batch.values is not None:
        var_ret = stats["ev/r2/mean"] - stats["ev/r/mean"] ** 2
        var_res = stats["ev/e2/mean"] - stats["ev/e/mean"] ** 2
        out["critic/vf_explained_var"] = 1.0 - var_res / (var_ret + 1e-5)
    return out


_GROUP_ORDER = (
    "actor",
    "critic",
    "reward",
    "response_length",
    "prompt_length",
    "response",
    "val-core",
    "val-aux",
    "train",
    "rollout_corr",
    "timing_s",
    "timing_per_token_ms",
    "perf",
    "training",
)


def format_console(step: int, metrics: dict[str, float]) -> str:
    """Compact console line block: one line per group (the key's first part), known groups first."""

    def group_of(key: str) -> str:
        if key.startswith(("critic/score", "critic/rewards")):
            return "reward"
        return key.split("/")[0] if "/" in key else "other"

    groups: dict[str, list[str]] = {}
    for k in sorted(metrics):
        v = metrics[k]
        short = k.split("/", 1)[1] if "/" in k else k
        groups.setdefault(group_of(k), []).append(f"{short}={v:.4g}")
    order = [g for g in _GROUP_ORDER if g in groups] + sorted(set(groups) - set(_GROUP_ORDER))
    lines = [f"step {step}"]
    width = max((len(g) for g in order), default=0)
    for g in order:
        lines.append(f"  {g:<{max(width, 15)}} " + "  ".join(groups[g]))
    return "\n".join(lines)


# The few numbers of the one-line console summary of a step, with short names.
_LINE_KEYS = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy"),
    ("critic/vf_loss", "vf_loss"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
)


def format_console_line(step: int, metrics: dict[str, float]) -> str:
    """One line per step: the score, the losses, the response length, the step time and any
    validation score; the full grouped block comes every trainer.console_block_freq steps."""
    parts = [f"{short}={metrics[k]:.4g}" for k, short in _LINE_KEYS if k in metrics]
    parts += [f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("val")]
    return f"step {step}  " + "  ".join(parts)


def set_aside(path: str) -> str | None:
    """Rename an earlier run's file ``name.ext`` to the first free ``name.N.ext``; returns the new path."""
    if not os.path.exists(path):
        return None
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    os.replace(path, f"{stem}.{n}{ext}")
    return f"{stem}.{n}{ext}"


class MetricsLogger:
    """Fan-out of one metrics dict per step to the sinks named in trainer.logger (rank 0 only).

    ``log_dir/metrics.jsonl`` is written whatever the sinks (the console is for people, the file for
    tools such as ``python -m megatron_rl.run.plot``); ``jsonl`` in trainer.logger asks for nothing more.
    It belongs to one run: :meth:`begin` keeps the rows of the steps a resumed run
    continues from (those after it are dropped, so no step appears twice) and moves the file of an
    earlier, unrelated run aside (``metrics.1.jsonl``, ...) rather than appending to it. The console
    gets one line per step and the grouped block every ``block_freq`` steps (and at the last one).
    """

    def __init__(
        self,
        sinks: list[str],
        log_dir: str,
        project: str,
        experiment: str,
        config: dict,
        enabled: bool,
        block_freq: int = 10,
    ):
        self.enabled = enabled
        self.sinks = sinks
        self.log_dir = log_dir
        self.block_freq = block_freq
        self._jsonl: TextIO | None = None
        self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "trainer.logger has tensorboard but it is not installed: pip install tensorboard"
                ) from e
            self._tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError(
                    "trainer.logger has wandb but it is not installed: pip install wandb"
                ) from e
            self._wandb = wandb.init(project=project, name=experiment, config=config)

    @property
    def jsonl_path(self) -> str:
        return os.path.join(self.log_dir, "metrics.jsonl")

    def begin(self, start_step: int) -> None:
        """Open the run's metrics.jsonl: a fresh run (``start_step`` 0) starts a new file, a run
        resumed at ``start_step`` continues the rows up to that step."""
        if not self.enabled:
            return
        path = self.jsonl_path
        kept: list[str] = []
        if os.path.isfile(path) and os.path.getsize(path):
            if start_step > 0:
                with open(path) as f:
                    kept = [
                        line for line in f if line.strip() and json.loads(line).get("step", 0) <= start_step
                    ]
            else:
                set_aside(path)
        self._jsonl = open(path, "w")
        self._jsonl.writelines(kept)
        self._jsonl.flush()

    def replay(self, step: int, row: dict[str, float] | None) -> None:
        """After a resume at ``step`` (and :meth:`begin`): the step's metrics ``row``, kept in its
        checkpoint, to the sinks but the console if metrics.jsonl lacks it (the run died after
        publishing the checkpoint, before writing the row)."""
        path = self.jsonl_path
        if row is None or not (self.enabled and "jsonl" in self.sinks and os.path.isfile(path)):
            return
        with open(path) as f:
            if any(json.loads(line).get("step") == step for line in f if line.strip()):
                return
        self.log(step, row, echo=lambda _line: None)

    def log(self, step: int, metrics: dict[str, float], echo=print, last: bool = False) -> None:
        if not self.enabled:
            return
        if "console" in self.sinks:
            block = step == 0 or last or (self.block_freq > 0 and step % self.block_freq == 0)
            echo(format_console(step, metrics) if block else format_console_line(step, metrics))
            sys.stdout.flush()  # a redirected stdout (Slurm, a pipe) is block-buffered: one step, one flush
        if self._jsonl is None:
            self.begin(0)  # not begun by the trainer: a fresh run
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def progress_bar(total: int, initial: int, enabled: bool):
    """The step bar on stderr; off when stderr or stdout is not a terminal (a Slurm log, a pipe), where
    its frames would be glued to the step lines. ``write`` prints a line either way."""
    from tqdm import tqdm

    tty = sys.stderr.isatty() and sys.stdout.isatty()
    return tqdm(
        total=total,
        initial=initial,
        desc="ppo",
        unit="step",
        disable=not (enabled and tty),
        file=sys.stderr,
        dynamic_ncols=True,
    )


# --------------------------------------------------------------------------------------------------
# The run record, beside the checkpoints (rank 0)
# --------------------------------------------------------------------------------------------------


def write_config_record(cfg, fresh: bool) -> None:
    """The resolved config of this run in trainer.default_local_dir/config.yaml. A fresh run in a
    directory that holds an earlier run's record sets that aside (config.1.yaml, summary.1.json, ...)."""
    from omegaconf import OmegaConf

    from megatron_rl.config import to_dict

    out = cfg.trainer.default_local_dir
    os.makedirs(out, exist_ok=True)
    if fresh:
        for name in ("config.yaml", "summary.json"):
            set_aside(os.path.join(out, name))
    OmegaConf.save(OmegaConf.create(to_dict(cfg)), os.path.join(out, "config.yaml"))


def write_summary(cfg, global_step: int, last: dict[str, float], checkpoint: str | None, jsonl: str) -> None:
    """Final scores and where everything is: printed, and summary.json beside the checkpoints."""
    from megatron_rl.optim import precision_record

    t = cfg.trainer
    scores = {k: v for k, v in last.items() if k.startswith(("val", "critic/score/mean"))}
    summary = {
        "global_step": global_step,
        "final": scores,
        "checkpoint": checkpoint,
        "config": os.path.join(t.default_local_dir, "config.yaml"),
        "metrics": jsonl,  # written whatever trainer.logger says
        "plot": f"python -m megatron_rl.run.plot {t.log_dir}",
        "precision": precision_record(cfg),
    }
    with open(os.path.join(t.default_local_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"megatron-rl: finished at step {global_step}"]
    lines += [f"  {k} = {v:.4g}" for k, v in sorted(scores.items())]
    lines.append(f"  checkpoint: {checkpoint or 'none saved'}")
    lines.append(f"  config:     {summary['config']}")
    lines.append(f"  metrics:    {summary['metrics']}   plot: {summary['plot']}")
    print("\n".join(lines), flush=True)
