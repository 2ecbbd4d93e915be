"""Megatron-core's training path for one model shard: DDP gradient buffers, its optimizer, our LR schedule.

:class:`ModelOptimizer` wraps a model built by :mod:`megatron_rl.models.builder` in megatron-core's
``DistributedDataParallel`` and builds megatron-core's optimizer over it (``get_megatron_optimizer``).
The same classes run on CPU over gloo (:mod:`megatron_rl.cpu_bridge` bridges their CUDA assumptions)
and on GPU over NCCL, so there is one gradient semantics. Data flow of one optimizer step, after the
micro-batches' backward passes (``run_pipeline`` on :attr:`ModelOptimizer.ddp`):

1. Backward hooks accumulate every parameter's gradient into DDP's contiguous buffers (``main_grad``,
   fp32 with ``grad_reduce_in_fp32``). Buckets are reduced over ``ps.dp_group`` as they fill when
   ``overlap_grad_reduce`` is on, otherwise after the last micro-batch; with the distributed optimizer
   the reduction is a reduce-scatter and each DP rank keeps only its 1/DP of the gradients.
   The reduction is a SUM (``calculate_per_token_loss``): each micro-batch loss is already its share
   of the mini-batch mean over all DP ranks (see :mod:`megatron_rl.ppo`).
2. ``finalize_model_grads`` (megatron) then sums what TP or PP ranks hold in pieces: layernorm weights
   under sequence parallelism, Qwen3's q/k-norm weights (each TP rank sees only its own heads), the two
   copies of a tied embedding on the first and last pipeline stages.
3. fp16 only: unscale by megatron's dynamic loss scale; an overflow skips the update and backs the
   scale off (:attr:`ModelOptimizer.loss_scale_skips`: routine, the scaler's own business). Then the
   global gradient norm over all TP/PP (and, sharded, DP) ranks, each element counted once. A
   non-finite norm the scaler cannot fix (bf16/fp32, or fp16 with the scale at its minimum) skips the
   update: counted in :attr:`ModelOptimizer.skipped_steps`. Either way the LR schedule does not
   advance, and the returned norm is inf.
4. Clip to ``clip_grad``, set the scheduled LR, Adam on the fp32 main parameters (bf16/fp16 models keep
   fp32 masters; the distributed optimizer shards masters and moments over DP), copy back into the
   model's parameters, rounded to nearest or stochastically (:mod:`megatron_rl.rounding`), all-gathered
   over DP when sharded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl import cpu_bridge
from megatron_rl.config import ConfigError, MegatronConfig, OptimConfig
from megatron_rl.errors import LaunchError
from megatron_rl.models.chunks import ModelChunks, chunks_of
from megatron_rl.parallel import ParallelState
from megatron_rl.rounding import MainToModel

BUCKET_NUMEL = 1 << 25  # 32M elements per DDP bucket (megatron's default scales with DP; fixed here)


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


def _finalize_grads(model: list[nn.Module], num_tokens: torch.Tensor | None = None, **kwargs: Any) -> None:
    """megatron's finalize_model_grads without its division by the token count: our losses arrive
    already normalised by the mini-batch's global denominator (step 1 of the module docstring)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)


class ModelOptimizer:
    """megatron-core DDP (one per model chunk) + optimizer over one model shard, with an LR schedule.

    ``ddp`` is the module the training passes run (``run_pipeline(optimizer.ddp, ...)``: a DDP, or a
    ModelChunks of them); the plain ``model`` serves no-grad forwards, the weight sync and checkpoints."""

    def __init__(
        self,
        model: nn.Module,
        cfg: OptimConfig,
        mcfg: MegatronConfig,
        ps: ParallelState,
        total_steps: int,
        key: str = "optim",
        seed: int = 0,
    ) -> None:
        """``seed`` (the run's seed), ``key`` (the optimizer's section: each role rounds with its own
        noise) and the step count seed stochastic rounding's noise (megatron_rl.seeds.ROUNDING)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters")
        self.ps, self.cfg, self.model = ps, cfg, model
        self.schedule = LRSchedule(cfg, total_steps, key)
        self.num_steps = 0
        self.skipped_steps = 0  # updates skipped for a non-finite norm the loss scaler cannot fix
        self.loss_scale_skips = 0  # fp16: updates skipped by the dynamic loss scaler (an overflow)
        # the distributed optimizer at every DP size (at 1 it holds all): one checkpoint format for any DP
        self.distributed = distributed = mcfg.use_distributed_optimizer
        self.overlap_param_gather = distributed and mcfg.overlap_param_gather
        config = model.config  # the TransformerConfig the schedule reads its hooks from
        dtype = config.params_dtype
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=mcfg.grad_reduce_in_fp32,
            overlap_grad_reduce=mcfg.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather,
            use_distributed_optimizer=distributed,
            bucket_size=BUCKET_NUMEL,
        )
        optim_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps,
            clip_grad=cfg.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            # fp16's dynamic loss scale (megatron's scaler; ignored for bf16/fp32)
            loss_scale=cfg.loss_scale,
            initial_loss_scale=cfg.initial_loss_scale,
            min_loss_scale=cfg.min_loss_scale,
            loss_scale_window=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
            use_distributed_optimizer=distributed,
            overlap_param_gather=self.overlap_param_gather,
        )
        with cpu_bridge.device_mode():  # one DDP per model chunk (interleaved pipelines), bucketed first
            chunks = enumerate(chunks_of(model))
            ddp = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in chunks]
            self.chunks, self.optimizer = ddp, get_megatron_optimizer(optim_config, ddp)
        self.ddp = self.chunks[0] if len(self.chunks) == 1 else ModelChunks(self.chunks)
        self.ddp.role, self.ddp.args = model.role, model.args
        config.finalize_model_grads_func = _finalize_grads
        config.grad_scale_func = self.optimizer.scale_loss  # the fp16 loss scale (1 otherwise)
        syncs = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync  # the schedule takes either
        config.no_sync_func = syncs if mcfg.overlap_grad_reduce else None
        self._init_adam_state()
        # bf16/fp16: our copy of the fp32 mains into the model (stochastic rounding; counts changes)
        self.main_to_model = MainToModel(cfg.stochastic_rounding, seed, key, ps.device)
        if dtype != torch.float32:
            for sub in self._sub_optimizers:
                self.main_to_model.install(sub, lambda: self.num_steps)

    @property
    def _sub_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _main_params(self) -> Iterator[tuple[torch.optim.Optimizer, dict, torch.Tensor]]:
        """(torch optimizer, param group, main parameter) of each parameter stepped on this rank."""
        for sub in self._sub_optimizers:
            inner = getattr(sub, "optimizer", None)
            for group in inner.param_groups if inner is not None else ():
                for p in group["params"]:
                    yield inner, group, p

    def _init_adam_state(self) -> None:
        """Adam's moments exist from the start rather than from the first step (as torch would create
        them): the memory a run needs shows at once, and host parking sees one fixed set of tensors."""
        for inner, _, p in self._main_params():
            if not inner.state[p]:
                inner.state[p] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def pop_update_fraction(self) -> float | None:
        """Fraction of the low-precision parameter elements that changed value in the steps since the
        last call (:meth:`megatron_rl.rounding.MainToModel.pop_update_fraction`; None for fp32 models).
        Collective over the whole job."""
        return self.main_to_model.pop_update_fraction()

    # -- the step -----------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for d in self.chunks:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()

    @torch.no_grad()
    def step(self) -> tuple[float, float]:
        """Clip and apply the reduced gradients (steps 3-4 of the module docstring).

        Returns (grad norm before clipping, LR used)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        lr = self.schedule.lr_at(self.num_steps)
        with cpu_bridge.device_mode():
            # Main grads ready; with fp16, unscaled and checked for overflow (the scaler updates itself
            # here: an overflow backs the scale off once per `hysteresis` overflows in a row).
            scale = self.loss_scale
            found_inf = self.optimizer.prepare_grads()
            if (
                found_inf
                and scale is not None
                and self.cfg.loss_scale is None
                and scale > self.cfg.min_loss_scale
            ):
                self.loss_scale_skips += 1  # the scaler handled it: a smaller scale next time
                return float("inf"), lr
            norm = float("inf") if found_inf else float(self.optimizer.get_grad_norm())
            if not math.isfinite(norm):
                self.skipped_steps += 1
                return norm, lr
            if self.cfg.clip_grad > 0:
                for sub in self._sub_optimizers:
                    params = sub.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, max_norm=self.cfg.clip_grad, total_norm=norm)
            # What megatron's OptimizerParamScheduler does each step: the groups carry multipliers
            # (wd_mult = 0 for biases and 1-D parameters), the values come from the schedule.
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
            self.optimizer.step_with_ready_grads()
            if self.overlap_param_gather:
                # The next forward may be the weight sync or a no-grad pass outside DDP: gather now.
                for d in self.chunks:
                    d.start_param_sync(force_sync=True)
        self.num_steps += 1
        return norm, lr

    @property
    def lr(self) -> float:
        """The LR the next step will use."""
        return self.schedule.lr_at(self.num_steps)

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None for bf16/fp32 models, which have none)."""
        if self.model.config.params_dtype != torch.float16:
            return None
        return float(self.optimizer.get_loss_scale())

    # -- offloading (see megatron_rl.offload) ------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """What the next step needs besides the model: Adam's moments and the fp32 main parameters
        (this rank's 1/DP of them with the distributed optimizer)."""
        model_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        out = []
        for inner, _, p in self._main_params():
            if p.untyped_storage().data_ptr() not in model_storages:
                out.append(p)  # an fp32 master; fp32 models train their own parameters (param_offload's)
            out += [t for t in inner.state[p].values() if torch.is_tensor(t) and t.dim()]
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        """DDP's gradient buffers; zeroed before every update, so their values need not be kept."""
        return [b.grad_data for d in self.chunks for b in d.buffers + d.expert_parallel_buffers]

    def state_bytes(self) -> int:
        """Bytes of :meth:`state_tensors` on this rank (optimizer-state memory per GPU)."""
        seen, total = set(), 0
        for t in self.state_tensors():
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    # -- checkpoints --------------------------------------------------------------------------------

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron's sharded optimizer state (dist_checkpointing); with the distributed optimizer it
        loads at any DP size (each DP rank's buffer shards re-sliced), at the TP/PP/VPP it was saved at."""
        kwargs = {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}} if self.distributed else {}
        state = self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, **kwargs)
        if not is_loading:
            _zero_padding(state)
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        with torch.no_grad(), cpu_bridge.device_mode():  # fp32 models: main params view the parameters
            self.optimizer.load_state_dict(state)
        # torch's Adam keeps its step count per parameter; megatron saves it once, in the param groups,
        # and its per-parameter restore writes back the count the states were created with.
        for inner, group, p in self._main_params():
            if "step" in group:
                inner.state[p]["step"] = torch.tensor(float(group["step"]))
        self.zero_grad()

    def counters(self) -> dict[str, int]:
        """The LR schedule's position (which also seeds stochastic rounding) and the skipped-step
        counts, saved beside the sharded state (the fp16 loss scale is in megatron's own state)."""
        return {
            "num_steps": self.num_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scale_skips": self.loss_scale_skips,
        }

    def load_counters(self, counters: dict[str, int]) -> None:
        self.num_steps = int(counters["num_steps"])
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self.loss_scale_skips = int(counters.get("loss_scale_skips", 0))


def _zero_padding(state: Any) -> None:
    """megatron fills the gaps between parameters in a saved bucket with ``torch.empty``: zero them, so
    that a checkpoint's bytes depend only on the training state."""
    if isinstance(state, dict):
        padding = state.get("padding")
        if getattr(padding, "obj", False) is True:
            for v in state.values():
                if hasattr(v, "data") and torch.is_tensor(v.data):
                    v.data.zero_()
        for v in state.values():
            _zero_padding(v)
    elif isinstance(state, list | tuple):
        for v in state:
            _zero_padding(v)


class NonFiniteError(LaunchError):
    """The run stopped after trainer.max_nonfinite_steps steps with non-finite updates (one line)."""

    same_on_all_ranks = True  # the gradient norms are reduced: every rank counts the same


NONFINITE_ADVANTAGES = "critic/advantages/nonfinite"
"""The metric counting a step's response tokens with a non-finite advantage."""


class NonFiniteGuard:
    """Counts PPO steps in a row with a skipped update (a non-finite loss or gradient norm that the
    fp16 loss scaler could not fix: the optimizer skipped those steps, so the weights stay finite) or
    with non-finite advantages. Each such step is logged; ``limit`` of them in a row
    (trainer.max_nonfinite_steps, 0 = never) stop the run before that step's save, keeping the last
    checkpoint as it was."""

    def __init__(self, limit: int, log=None) -> None:
        self.limit, self.log, self.streak = limit, log, 0

    def check(self, metrics: dict[str, float], step: int, latest_checkpoint) -> None:
        skipped = {
            phase: int(metrics.get(f"{role}/nonfinite_grad_steps", 0))
            for phase, role in (("update_actor", "actor"), ("update_critic", "critic"))
        }
        # NaN/inf advantages: no loss scale or skipped update fixes what the step would learn from
        skipped["advantages (tokens)"] = int(metrics.get(NONFINITE_ADVANTAGES, 0))
        if not any(skipped.values()):
            self.streak = 0
            return
        self.streak += 1
        where = ", ".join(f"{phase}: {n}" for phase, n in skipped.items() if n)
        if self.log is not None:
            self.log.warning(
                "step %d: optimizer steps skipped for a non-finite loss or gradient norm, or non-finite "
                "advantages (%s); %d step(s) in a row",
                step,
                where,
                self.streak,
            )
        if self.limit > 0 and self.streak >= self.limit:
            latest = latest_checkpoint()
            raise NonFiniteError(
                f"{self.streak} steps in a row (the last: step {step}, {where}) had a non-finite loss, "
                f"gradient norm or advantage, so the run stopped (trainer.max_nonfinite_steps={self.limit}); "
                f"the last checkpoint is {latest or 'none (nothing was saved)'}. Lower "
                "actor_rollout_ref.actor.optim.lr / critic.optim.lr or set *.optim.clip_grad, then resume."
            )


def count_nonfinite(values: torch.Tensor, mask: torch.Tensor, group) -> int:
    """Response tokens ([B, R] ``values`` where ``mask``) whose value is NaN or inf, summed over
    ``group``: the advantages' count makes a step a non-finite one for :class:`NonFiniteGuard` whatever
    the optimizer did (an fp16 scaler would take their NaN gradients for an overflow and back off)."""
    bad = (~torch.isfinite(values) & mask.bool()).sum().to(torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(bad, group=group)
    return int(bad.item())


def precision_notices(cfg) -> list[str]:
    """One line per dtype key set to half precision where the job runs on CPU: the models and the
    engine run in float32 there (CPU kernels have no half-precision speed-up), and summary.json records
    float32; the line says so rather than let config.yaml's value stand unexplained. A key left at its
    (GPU) default is not named."""
    record = precision_record(cfg)
    default = MegatronConfig().params_dtype
    arr = cfg.actor_rollout_ref
    asked = {"actor_rollout_ref.actor.megatron.params_dtype": (arr.actor.megatron.params_dtype, "actor")}
    if cfg.critic.enable:
        asked["critic.megatron.params_dtype"] = (cfg.critic.megatron.params_dtype, "critic")
    out = []
    for key, (value, role) in asked.items():
        if value not in (record[role]["params_dtype"], default):
            out.append(f"{key}={value} is for the GPU: on CPU the {role} trains in float32.")
    # rollout.dtype follows the actor's params_dtype unless set: one line for the two
    if arr.rollout.dtype not in (None, record["rollout"]["dtype"], arr.actor.megatron.params_dtype):
        out.append(
            f"actor_rollout_ref.rollout.dtype={arr.rollout.dtype} is for the GPU: "
            "on CPU the engine runs in float32."
        )
    return out


def precision_record(cfg) -> dict[str, dict[str, object]]:
    """What precision each trained model and the engine ran at (summary.json): the dtypes as built
    (fp32 on CPU, whatever params_dtype says), the rounding of the fp32 masters into them and fp16's
    loss scale."""
    from megatron_rl.model_args import run_dtype
    from megatron_rl.parallel import resolve_device

    device, arr = resolve_device(cfg.trainer.device), cfg.actor_rollout_ref

    def trained(mcfg: MegatronConfig, optim: OptimConfig) -> dict[str, object]:
        dtype = run_dtype(mcfg.params_dtype, device)
        rec: dict[str, object] = {"params_dtype": dtype}
        if dtype == "bfloat16":
            rec["rounding"] = "stochastic" if optim.stochastic_rounding else "nearest"
        if dtype == "float16":
            rec["loss_scale"] = optim.loss_scale or f"dynamic from {optim.initial_loss_scale:g}"
        return rec

    out = {"actor": trained(arr.actor.megatron, arr.actor.optim)}
    if cfg.critic.enable:
        out["critic"] = trained(cfg.critic.megatron, cfg.critic.optim)
    out["rollout"] = {"dtype": run_dtype(arr.rollout.dtype, device)}
    return out
