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
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                self.max_device_used = max(self.max_device_used, total - free)

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        self.times = {}
        return out


def _stats(name: str, x: torch.Tensor, group) -> dict[str, float]:
    """mean/max/min of a 1-D tensor over all data-parallel ranks."""
    x = x.double().flatten()
    t = torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=torch.float64)]).to(x.device)
    mx, mn = (
        x.max().clone() if x.numel() else torch.tensor(-1e30),
        x.min().clone() if x.numel() else torch.tensor(1e30),
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=group)
    return {
        f"{name}/mean": (t[0] / t[1].clamp(min=1)).item(),
        f"{name}/max": mx.item(),
        f"{name}/min": mn.item(),
    }


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group) -> float:
    """1 - Var[returns - values] / Var[returns] over the masked tokens of all data-parallel ranks."""
    ret, res = returns[mask.bool()].double(), (returns - values)[mask.bool()].double()
    t = torch.stack(
        [
            torch.tensor(float(ret.numel()), dtype=torch.float64, device=ret.device),
            ret.sum(),
            (ret * ret).sum(),
            res.sum(),
            (res * res).sum(),
        ]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    n = t[0].clamp(min=1)
    var_ret = t[2] / n - (t[1] / n) ** 2
    var_res = t[4] / n - (t[3] / n) ** 2
    return (1.0 - var_res / (var_ret + 1e-5)).item()


def _masked_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def data_metrics(batch: RolloutBatch, max_response_length: int, dp_group) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values, response_length, ..."""
    m = batch.response_mask
    resp_len = m.sum(-1)
    prompt_len = batch.attention_mask[:, : batch.prompts.shape[1]].sum(-1).float()
    out: dict[str, float] = {}
    out.update(_stats("critic/score", batch.token_level_scores.sum(-1), dp_group))
    out.update(_stats("critic/rewards", batch.token_level_rewards.sum(-1), dp_group))
    out.update(_stats("critic/advantages", _masked_tokens(batch.advantages, m), dp_group))
    out.update(_stats("critic/returns", _masked_tokens(batch.returns, m), dp_group))
    if batch.values is not None:
        out.update(_stats("critic/values", _masked_tokens(batch.values, m), dp_group))
        out["critic/vf_explained_var"] = _explained_variance(batch.values, batch.returns, m, dp_group)
    out.update(_stats("response_length", resp_len, dp_group))
    clipped = (resp_len >= max_response_length).float()
    out["response_length/clip_ratio"] = _stats("c", clipped, dp_group)["c/mean"]
    out.update(_stats("prompt_length", prompt_len, dp_group))
    return out


_GROUP_ORDER = (
    "actor",
    "critic",
    "reward",
    "response_length",
    "prompt_length",
    "val",
    "timing_s",
    "perf",
    "training",
)


def format_console(step: int, metrics: dict[str, float]) -> str:
    """Compact console line block: one line per group, in a fixed order."""

    def group_of(key: str) -> str:
        head = key.split("/")[0]
        if key.startswith(("critic/score", "critic/rewards")):
            return "reward"
        return head if head in _GROUP_ORDER else "other"

    groups: dict[str, list[str]] = {}
    for k in sorted(metrics):
        v = metrics[k]
        short = k.split("/", 1)[1] if "/" in k else k
        groups.setdefault(group_of(k), []).append(f"{short}={v:.4g}")
    lines = [f"step {step}"]
    for g in (*_GROUP_ORDER, "other"):
        if g in groups:
            lines.append(f"  {g:<15} " + "  ".join(groups[g]))
    return "\n".join(lines)


class MetricsLogger:
    """Fan-out of one metrics dict per step to the sinks named in trainer.logger (rank 0 only)."""

    def __init__(
        self, sinks: list[str], log_dir: str, project: str, experiment: str, config: dict, enabled: bool
    ):
        self.enabled = enabled
        self.sinks = sinks
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "jsonl" in sinks:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a")
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

    def log(self, step: int, metrics: dict[str, float], echo=print) -> None:
        if not self.enabled:
            return
        if "console" in self.sinks:
            echo(format_console(step, metrics))
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
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="ppo",
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )
