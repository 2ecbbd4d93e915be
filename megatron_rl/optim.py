"""Optimizer for one model shard: data-parallel gradient buckets, global-norm clipping, AdamW, LR schedule.

Data flow of one optimizer step (:meth:`ModelOptimizer.step`), after the micro-batches' backward passes
have accumulated gradients:

1. Gradients live in flat fp32 buckets (``param.grad`` of an fp32 parameter is a view into a bucket,
   so autograd accumulates micro-batches in place; a bf16/fp16 parameter adds its gradient to the
   bucket through a post-accumulate hook and is trained through an fp32 master copy).
2. Each bucket is all-reduced over ``ps.dp_group`` and divided by the DP size (an average: losses are
   scaled by the DP size so that the average is the gradient of the global mini-batch loss).
3. With pipeline parallelism and tied embeddings, the two copies of the shared embedding/head weight
   (first and last stage, marked ``shared_embedding`` by megatron) are summed over
   ``ps.embedding_group``, so both receive the same update.
4. Global gradient norm: squares of this rank's gradients, counting TP-sharded parameters on every TP
   rank, TP-replicated ones (norms, the value head) on TP rank 0 only, and the last stage's copy of a
   tied weight (``shared``) not at all; summed over the model-parallel group (TP x PP). Which
   parameters are sharded comes from the weight table (:func:`tp_sharded_params`). DP replicas hold
   equal gradients after step 2 and are not summed.
5. Clip to ``clip_grad`` (coefficient ``clip_grad / (norm + 1e-6)`` when below 1, as megatron does),
   set the scheduled LR, ``torch.optim.AdamW`` (no weight decay on biases and 1-D parameters), copy
   masters back into low-precision parameters. A non-finite norm skips the update (and the schedule
   does not advance); the returned norm shows it.

The same math runs on CPU (gloo) and GPU (nccl). Extension point: on GPU, megatron-core's
``DistributedDataParallel`` with its distributed optimizer (``get_megatron_optimizer``, sharded
optimizer states, overlapped reduce-scatter) can replace this class behind the same interface
(``step() -> (grad_norm, lr)``, ``zero_grad()``, ``state_dict()``, ``load_state_dict()``); megatron's
version hard-codes CUDA, which is why this plain path exists.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.config import ConfigError, OptimConfig
from megatron_rl.parallel import ParallelState

BUCKET_NUMEL = 1 << 25  # 32M fp32 elements (128 MiB) per all-reduce bucket


class LRSchedule:
    """Linear warmup, then constant / cosine / linear decay from ``lr`` to ``min_lr`` at ``total_steps``.

    ``lr_at(k)`` is the LR of optimizer step k (0-based). Warmup is ``lr * (k + 1) / warmup`` so that the
    first step already learns and step ``warmup - 1`` reaches the peak.
    """

    def __init__(self, cfg: OptimConfig, total_steps: int, key: str = "optim") -> None:
        if cfg.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ConfigError(f"{key}.lr_decay_style={cfg.lr_decay_style!r}: use constant, cosine or linear.")
        if cfg.lr_warmup_steps >= 0:
            warmup = cfg.lr_warmup_steps
        else:
            if not 0.0 <= cfg.lr_warmup_steps_ratio <= 1.0:
                raise ConfigError(
                    f"{key}.lr_warmup_steps_ratio={cfg.lr_warmup_steps_ratio} must be in [0, 1]."
                )
            if cfg.lr_warmup_steps_ratio > 0 and total_steps <= 0:
                raise ConfigError(
                    f"{key}.lr_warmup_steps_ratio needs the total number of optimizer steps "
                    f"(got {total_steps}); set {key}.lr_warmup_steps instead."
                )
            warmup = int(cfg.lr_warmup_steps_ratio * max(total_steps, 0))
        if cfg.lr_decay_style != "constant" and total_steps <= 0:
            raise ConfigError(
                f"{key}.lr_decay_style={cfg.lr_decay_style} needs the total number of optimizer steps "
                f"(got {total_steps}); use lr_decay_style=constant or set trainer.total_training_steps."
            )
        self.lr, self.min_lr, self.style = cfg.lr, cfg.min_lr, cfg.lr_decay_style
        self.warmup, self.total = warmup, total_steps

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.style == "constant":
            return self.lr
        progress = min(max((step - self.warmup) / max(1, self.total - self.warmup), 0.0), 1.0)
        if self.style == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr - (self.lr - self.min_lr) * progress


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate hook of a bf16/fp16 parameter: add its gradient to the fp32 bucket, free it."""
    param.main_grad.add_(param.grad.float())
    param.grad = None


def tp_sharded_params(model: nn.Module, ps: ParallelState) -> set[int]:
    """ids of the parameters split over TP (each TP rank holds different elements).

    ``models.builder.mark_tensor_parallel`` sets megatron's ``tensor_model_parallel`` attribute from
    the weight tables (megatron itself sets it only when it initialises the weights).
    """
    if ps.tp_size == 1:
        return set()
    return {id(p) for p in model.parameters() if getattr(p, "tensor_model_parallel", False)}


class ModelOptimizer:
    """AdamW over one model shard with DP-averaged, globally clipped gradients (see module docstring)."""

    def __init__(
        self, model: nn.Module, cfg: OptimConfig, ps: ParallelState, total_steps: int, key: str = "optim"
    ) -> None:
        self.ps = ps
        self.cfg = cfg
        self.schedule = LRSchedule(cfg, total_steps, key)
        self.num_steps = 0
        self.skipped_steps = 0
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.params = [p for _, p in named]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        # masters[i]: the fp32 tensor AdamW updates (the parameter itself when it is fp32).
        self.masters: list[torch.Tensor] = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            for p in self.params
        ]
        self._build_buckets()
        for p in self.params:
            if p.dtype != torch.float32 and not getattr(p, "_main_grad_hook", False):
                # Once per parameter: a later optimizer over the same model re-points main_grad.
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
                p._main_grad_hook = True
        decay, no_decay = [], []
        for (name, p), m in zip(named, self.masters, strict=True):
            (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(m)
        groups = [
            g
            for g in (
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            )
            if g["params"]
        ]
        self.optimizer = torch.optim.AdamW(
            groups, lr=self.schedule.lr_at(0), betas=tuple(cfg.betas), eps=cfg.eps
        )
        # AdamW's moments exist from the start rather than from the first step (as torch would create
        # them): the memory a run needs shows at once, and host parking sees one fixed set of tensors.
        for m in self.masters:
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format),
            }
        # Each gradient element enters the norm once: TP-sharded parameters on every TP rank, replicated
        # ones on TP rank 0, the last stage's copy of a tied embedding (``shared``) nowhere.
        sharded = tp_sharded_params(model, ps)
        self._norm_mask = [
            not getattr(p, "shared", False) and (id(p) in sharded or ps.tp_rank == 0) for p in self.params
        ]
        self._tied = [p for p in self.params if getattr(p, "shared_embedding", False)]

    # -- gradient buffers ---------------------------------------------------------------------------

    def _build_buckets(self) -> None:
        """Flat fp32 buckets on the parameters' device; each master's ``.grad`` is a view into one."""
        self.buckets: list[torch.Tensor] = []
        self._main_grad: dict[int, torch.Tensor] = {}
        start = 0
        members: list[int] = []

        def close(members: list[int]) -> None:
            if not members:
                return
            device = self.params[members[0]].device
            flat = torch.zeros(
                sum(self.params[i].numel() for i in members), dtype=torch.float32, device=device
            )
            off = 0
            for i in members:
                n = self.params[i].numel()
                view = flat[off : off + n].view_as(self.params[i])
                self._main_grad[id(self.params[i])] = view
                if self.masters[i] is not self.params[i]:
                    self.params[i].main_grad = view  # target of _accumulate_into_main_grad
                self.masters[i].grad = view
                off += n
            self.buckets.append(flat)

        for i, p in enumerate(self.params):
            if members and (start + p.numel() > BUCKET_NUMEL or p.device != self.params[members[0]].device):
                close(members)
                members, start = [], 0
            members.append(i)
            start += p.numel()
        close(members)

    def zero_grad(self) -> None:
        for flat in self.buckets:
            flat.zero_()
        for p, m in zip(self.params, self.masters, strict=True):
            # Re-attach the views (after model.zero_grad(set_to_none=True), or another optimizer built
            # over the same model).
            m.grad = self._main_grad[id(p)]
            if m is not p:
                p.main_grad = self._main_grad[id(p)]
                p.grad = None

    def _check_views(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            view = self._main_grad[id(p)]
            target = m.grad if m is p else getattr(p, "main_grad", None)
            if target is None or m.grad is None or target.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    "a parameter's gradient no longer points into this optimizer's gradient bucket "
                    "(model.zero_grad(set_to_none=True), or another optimizer over the same model?): call "
                    "ModelOptimizer.zero_grad() before the backward passes."
                )

    # -- the step -----------------------------------------------------------------------------------

    def reduce_grads(self) -> None:
        """Average over DP ranks, then sum the two copies of a tied embedding over the embedding group."""
        ps = self.ps
        if ps.dp_size > 1:
            for flat in self.buckets:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ps.dp_group)
                flat.div_(ps.dp_size)
        if ps.pp_size > 1 and self._tied:
            for p in self._tied:
                dist.all_reduce(self._main_grad[id(p)], op=dist.ReduceOp.SUM, group=ps.embedding_group)

    def grad_norm(self) -> float:
        """Global L2 norm of the (reduced) gradients over all TP and PP shards."""
        device = self.buckets[0].device
        counted = zip(self.params, self._norm_mask, strict=True)
        grads = [self._main_grad[id(p)] for p, keep in counted if keep]
        if grads:
            sq = torch.stack([torch.linalg.vector_norm(g) for g in grads]).square().sum()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=device)
        if self.ps.tp_size * self.ps.pp_size > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.ps.mp_group)
        return math.sqrt(sq.item())

    def step(self) -> tuple[float, float]:
        """Reduce, clip and apply the accumulated gradients. Returns (grad norm before clipping, LR used)."""
        self._check_views()
        self.reduce_grads()
        norm = self.grad_norm()
        lr = self.schedule.lr_at(self.num_steps)
        if not math.isfinite(norm):
            self.skipped_steps += 1
            return norm, lr
        if self.cfg.clip_grad > 0:
            coeff = self.cfg.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for flat in self.buckets:
                    flat.mul_(coeff)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    if m is not p:
                        p.copy_(m)
        self.num_steps += 1
        return norm, lr

    # -- offloading (see megatron_rl.offload) ------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """What the next step needs besides the model: AdamW's moments and the fp32 masters."""
        moments = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return self._low_precision_masters() + moments

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient buckets; zeroed before every update, so their values need not be kept."""
        return list(self.buckets)

    @property
    def lr(self) -> float:
        """The LR the next step will use."""
        return self.schedule.lr_at(self.num_steps)

    # -- checkpoints --------------------------------------------------------------------------------

    def _low_precision_masters(self) -> list[torch.Tensor]:
        return [m for p, m in zip(self.params, self.masters, strict=True) if m is not p]

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: AdamW moments, step counters (the LR schedule's position) and,
        for low-precision models, the fp32 master weights."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "num_steps": self.num_steps,
            "skipped_steps": self.skipped_steps,
            "master_params": [m.detach().clone() for m in self._low_precision_masters()],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the schedule's shape comes from the current config."""
        self.optimizer.load_state_dict(sd["optimizer"])
        self.num_steps = int(sd["num_steps"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))
        masters = self._low_precision_masters()
        saved = sd.get("master_params", [])
        if len(saved) != len(masters):
            raise ValueError(
                f"optimizer checkpoint holds {len(saved)} fp32 master tensors, this model needs "
                f"{len(masters)}: was it saved with a different params_dtype or parallel layout?"
            )
        with torch.no_grad():
            for m, s in zip(masters, saved, strict=True):
                m.copy_(s)
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        self.zero_grad()


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, ps: ParallelState, total_steps: int, key: str = "optim"
) -> ModelOptimizer:
    """The optimizer of one model shard; ``total_steps`` optimizer steps define the LR schedule.

    ``key`` is the config prefix named in error messages (e.g. ``actor_rollout_ref.actor.optim``).
    """
    return ModelOptimizer(model, cfg, ps, total_steps, key)
