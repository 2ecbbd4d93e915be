"""The models of a run, by role: actor (+ optimizer), reference, reward model; and the critic's builder.

    build_models(cfg, ps, model_args, total_steps)
        actor     actor_rollout_ref.model.path, trained (ModelOptimizer over megatron's DDP)
        ref       the same weights, frozen; only when a KL term needs it (use_kl_loss / use_kl_in_reward)
                  and the actor trains all its weights (with LoRA: the actor, its adapters off)
        reward    reward_model.model.path with a score head, frozen; when reward_model.enable
    With actor.router_replay.mode=R3 the actor's routers replay the engine's routing (models/routing.py).
    build_critic(cfg, ps, total_steps)
        critic    critic.model.path with a value head, trained; when critic.enable (GAE by default).
                  Handed to the critic role (roles.critic.make_critic; on ranks of its own the critic
                  server builds it), its only home: Models holds no critic.

Each role uses its own ``megatron`` section for dtype, attention and activation recompute; the parallel
layout (TP x PP) is the actor's for all of them (validated with the config); a critic on ranks of its
own (trainer.placement.critic) is built there by ``build_critic``. LR schedules span the optimizer
steps each model will actually take (the actor none during trainer.critic_warmup).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from megatron_rl.config import Config, FrozenMegatronConfig, needs_reference
from megatron_rl.config.layout import check_replay_model
from megatron_rl.config.lora import LoraConfig
from megatron_rl.parallel import ParallelState

if TYPE_CHECKING:
    from megatron_rl.optim import ModelOptimizer


@dataclasses.dataclass
class Models:
    actor: torch.nn.Module
    actor_optim: ModelOptimizer
    ref: torch.nn.Module | None
    reward: torch.nn.Module | None = None  # reward_model.enable


def _model(
    ps: ParallelState,
    args,
    role: str,
    path: str,
    mcfg: FrozenMegatronConfig,
    recompute: bool = False,
    lora: tuple[str, LoraConfig, int] | None = None,
) -> torch.nn.Module:
    """One role's model with its weights loaded (fp32 on CPU: CPU kernels have no bf16 speed-up);
    ``lora``: (config key, the model's lora section, seed) adds its adapters, the base frozen."""
    from megatron_rl.model_args import DTYPES, run_dtype
    from megatron_rl.models.builder import TrainingOptions, build_model
    from megatron_rl.models.loading import load_weights

    dtype = DTYPES[run_dtype(mcfg.params_dtype, ps.device)]
    ep = mcfg.expert_model_parallel_size
    if args.is_moe and ep is not None and ep != ps.ep_size:
        raise ValueError(
            f"*.megatron.expert_model_parallel_size={ep} but the process groups were started with EP="
            f"{ps.ep_size}: pass it to parallel.init_parallel(ep=...)."
        )
    options = TrainingOptions(
        sequence_parallel=mcfg.sequence_parallel,
        recompute_granularity=mcfg.recompute_granularity if recompute else None,
        recompute_method=mcfg.recompute_method,
        recompute_num_layers=mcfg.recompute_num_layers,
        virtual_pipeline=mcfg.virtual_pipeline_model_parallel_size or 1,
        # its moe_* keys are read by moe_options
        transformer_overrides=tuple(
            (k, v) for k, v in mcfg.override_transformer_config.items() if not k.startswith("moe_")
        ),
        lora=lora is not None and lora[1].rank > 0,  # adapters run on the local layers only
        packed_sequences=bool(mcfg.use_remove_padding),
        **moe_options(mcfg),
    )
    m = build_model(args, ps, role=role, dtype=dtype, sdpa=mcfg.use_sdpa_attention, options=options)
    load_weights(m, path, ps)
    if lora is not None and lora[1].rank > 0:
        from megatron_rl.models.lora import add_adapters
        from megatron_rl.models.lora_files import load_peft

        key, spec, seed = lora
        add_adapters(m, spec, ps, key, path, seed)
        if spec.adapter_path:
            load_peft(m, spec.adapter_path, ps, f"{key}.adapter_path")
    return m


def moe_options(mcfg: FrozenMegatronConfig) -> dict:
    """MoE settings from verl's ``*.megatron.override_transformer_config.moe_*`` keys, where the config
    holds them: ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``, ``moe_router_dtype`` (fp32 only),
    ``moe_grouped_gemm`` (grouped-matmul experts, the default; false: one MLP per expert) and
    ``moe_router_bias_update_rate`` (sigmoid routing's expert-score bias; megatron's 1e-3 by default)."""
    override = getattr(mcfg, "override_transformer_config", None) or {}
    get = override.get if isinstance(override, dict) else lambda k, d=None: getattr(override, k, d)
    dtype = get("moe_router_dtype", None)
    if dtype not in (None, "fp32"):
        raise ValueError(
            f"*.megatron.override_transformer_config.moe_router_dtype={dtype!r}: the router runs in fp32 "
            "(accepted: fp32)."
        )
    return {
        "moe_aux_loss_coeff": float(get("moe_aux_loss_coeff", 0.0) or 0.0),
        "moe_z_loss_coeff": float(get("moe_z_loss_coeff", 0.0) or 0.0),
        "moe_grouped_gemm": bool(get("moe_grouped_gemm", True)),
        "moe_router_bias_update_rate": float(get("moe_router_bias_update_rate", 1e-3)),
    }


def _optim_steps(cfg: Config, epochs: int | None, mini_batch: int | None, ppo_steps: int) -> int:
    """Optimizer steps of ``ppo_steps`` PPO updates (the length of an LR schedule); ``epochs`` and
    ``mini_batch`` as config.validate resolved them (a critic's default to the actor's)."""
    if epochs is None or mini_batch is None:
        raise ValueError("ppo_epochs / ppo_mini_batch_size unresolved: run config.validate(cfg) first")
    return ppo_steps * epochs * (cfg.data.train_batch_size // mini_batch)


def build_critic(
    cfg: Config, ps: ParallelState, total_steps: int, model_args=None
) -> tuple[torch.nn.Module, ModelOptimizer]:
    """The critic (critic.model.path with a value head) and its optimizer, on ``ps``'s ranks;
    ``model_args``: critic.model.path's, when the caller has read them already."""
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.optim import ModelOptimizer

    c = cfg.critic
    path = c.model.path
    args = model_args or load_model_args_any(path)
    seed = cfg.actor_rollout_ref.actor.megatron.seed  # the job's; the critic's keys keep its streams apart
    lora = ("critic.model.lora", c.model.lora, seed)
    critic = _model(ps, args, "critic", path, c.megatron, c.model.enable_gradient_checkpointing, lora)
    steps = _optim_steps(cfg, c.ppo_epochs, c.ppo_mini_batch_size, total_steps)
    return critic, ModelOptimizer(critic, c.optim, c.megatron, ps, steps, key="critic.optim", seed=seed)


def build_models(
    cfg: Config, ps: ParallelState, model_args, total_steps: int, with_critic: bool = True
) -> tuple[Models, tuple[torch.nn.Module, ModelOptimizer] | None]:
    """The run's models (module docstring) and, apart, the critic and its optimizer (None without
    critic.enable, or with ``with_critic=False``: it trains on ranks of its own), which go to the critic
    role. ``model_args`` are the actor's. Built in the order actor, ref, critic, reward."""
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.optim import ModelOptimizer

    arr = cfg.actor_rollout_ref
    check_replay_model(cfg, model_args.is_moe)
    replay = arr.actor.router_replay.mode in ("R2", "R3")
    lora = ("actor_rollout_ref.model.lora", arr.model.lora, arr.actor.megatron.seed)
    actor = _model(
        ps,
        model_args,
        "actor",
        arr.model.path,
        arr.actor.megatron,
        arr.model.enable_gradient_checkpointing,
        lora,
    )
    if replay:
        from megatron_rl.models.routing import enable_replay

        enable_replay(actor)  # before DDP wraps it
    actor_steps = _optim_steps(
        cfg, arr.actor.ppo_epochs, arr.actor.ppo_mini_batch_size, total_steps - cfg.trainer.critic_warmup
    )
    actor_optim = ModelOptimizer(
        actor,
        arr.actor.optim,
        arr.actor.megatron,
        ps,
        actor_steps,
        key="actor_rollout_ref.actor.optim",
        seed=arr.actor.megatron.seed,
    )
    ref = None  # with LoRA the reference is the actor without its adapters (roles.actor.RefRole)
    if needs_reference(cfg) and not arr.model.lora.rank:
        ref = _model(ps, model_args, "actor", arr.model.path, arr.ref.megatron).eval()
    critic = None
    if cfg.critic.enable and with_critic:
        same_trunk = cfg.critic.model.path == arr.model.path  # the actor's config, read once
        critic = build_critic(cfg, ps, total_steps, model_args if same_trunk else None)
    reward = None
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        reward = _model(ps, load_model_args_any(rm.model.path), "reward", rm.model.path, rm.megatron).eval()
    return Models(actor, actor_optim, ref, reward), critic


def park_for_generation(models: Models, critic, cfg: Config, parking, plan=None) -> None:
    """Before generation: park in host memory what ``plan`` (run.memory_plan.OffloadPlan; None: the
    *.megatron.*_offload keys alone) names (offload.HostParking); the actor's parameters are parked by
    the caller after the weight sync, which reads them. ``critic``: the critic role (its module and
    optimizer when it trains on these ranks)."""
    from megatron_rl.run.memory_plan import config_plan

    plan, park = plan or config_plan(cfg), parking.park
    trained = [("actor", models.actor, models.actor_optim)]
    if critic.model is not None:
        trained.append(("critic", critic.model, critic.optim))
    for name, model, optim in trained:
        if plan.parks(name, "optimizer"):
            park(optim.state_tensors())
        if plan.parks(name, "grads"):
            park(optim.grad_tensors(), keep_values=False)
        if plan.parks(name, "params") and name != "actor":
            park(model.parameters())
    for name, frozen in (("ref", models.ref), ("reward", models.reward)):
        if frozen is not None and plan.parks(name, "params"):
            park(frozen.parameters())
