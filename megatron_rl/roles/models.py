"""The models of a run, by role: actor (+ optimizer), reference, critic (+ optimizer), reward model.

    build_models(cfg, ps, model_args, total_steps)
        actor     actor_rollout_ref.model.path, trained (ModelOptimizer over megatron's DDP)
        ref       the same weights, frozen; only when a KL term needs it (use_kl_loss / use_kl_in_reward)
        critic    critic.model.path with a value head, trained; when critic.enable (GAE by default)
        reward    reward_model.model.path with a score head, frozen; when reward_model.enable

Each role uses its own ``megatron`` section for dtype, attention and activation recompute; the parallel
layout (TP x PP) is the actor's for all of them (validated with the config); a critic on ranks of its
own (trainer.placement.critic) is built there by ``build_critic``. LR schedules span the optimizer
steps each model will actually take (the actor none during trainer.critic_warmup).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.config import Config, MegatronConfig
from megatron_rl.parallel import ParallelState


@dataclasses.dataclass
class Models:
    actor: torch.nn.Module
    actor_optim: object
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    critic_optim: object | None
    reward: torch.nn.Module | None = None  # reward_model.enable


def _model(
    ps: ParallelState, args, role: str, path: str, mcfg: MegatronConfig, recompute: bool = False
) -> torch.nn.Module:
    """One role's model with its weights loaded (fp32 on CPU: CPU kernels have no bf16 speed-up)."""
    from megatron_rl.model_args import DTYPES
    from megatron_rl.models.builder import TrainingOptions, build_model
    from megatron_rl.models.loading import load_weights

    dtype = torch.float32 if ps.device.type == "cpu" else DTYPES[mcfg.params_dtype]
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
        # its moe_* keys are read by moe_options
        transformer_overrides=tuple(
            (k, v) for k, v in mcfg.override_transformer_config.items() if not k.startswith("moe_")
        ),
        **moe_options(mcfg),
    )
    m = build_model(args, ps, role=role, dtype=dtype, sdpa=mcfg.use_sdpa_attention, options=options)
    load_weights(m, path, ps)
    return m


def moe_options(mcfg: MegatronConfig) -> dict:
    """Router-loss settings from verl's ``*.megatron.override_transformer_config.moe_*`` keys, where the
    config holds them (``moe_aux_loss_coeff``, ``moe_z_loss_coeff``, ``moe_router_dtype``: fp32 only)."""
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
    }


def _optim_steps(cfg: Config, epochs: int, mini_batch: int, ppo_steps: int) -> int:
    """Optimizer steps of ``ppo_steps`` PPO updates (the length of an LR schedule)."""
    return ppo_steps * epochs * (cfg.data.train_batch_size // mini_batch)


def build_critic(
    cfg: Config, ps: ParallelState, total_steps: int, model_args=None
) -> tuple[torch.nn.Module, object]:
    """The critic (critic.model.path with a value head) and its optimizer, on ``ps``'s ranks;
    ``model_args``: critic.model.path's, when the caller has read them already."""
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.optim import ModelOptimizer

    c = cfg.critic
    path = c.model.path
    args = model_args or load_model_args_any(path)
    critic = _model(ps, args, "critic", path, c.megatron, c.model.enable_gradient_checkpointing)
    steps = _optim_steps(cfg, c.ppo_epochs, c.ppo_mini_batch_size, total_steps)
    seed = cfg.actor_rollout_ref.actor.megatron.seed + 1  # the critic's rounding noise: its own stream
    return critic, ModelOptimizer(critic, c.optim, c.megatron, ps, steps, key="critic.optim", seed=seed)


def build_models(
    cfg: Config, ps: ParallelState, model_args, total_steps: int, with_critic: bool = True
) -> Models:
    """The run's models (module docstring); ``model_args`` are the actor's. ``with_critic=False``: the
    critic trains on ranks of its own (megatron_rl.roles.critic), not here."""
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.optim import ModelOptimizer

    arr = cfg.actor_rollout_ref
    if model_args.is_moe:
        raise ValueError(
            f"{arr.model.path}: a mixture-of-experts actor ({model_args.arch}) trains, but its experts "
            "cannot yet be streamed into the rollout engine (rollout.reshard has no expert path)."
        )
    actor = _model(
        ps, model_args, "actor", arr.model.path, arr.actor.megatron, arr.model.enable_gradient_checkpointing
    )
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
    ref = None
    if cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss:
        ref = _model(ps, model_args, "actor", arr.model.path, arr.ref.megatron).eval()
    critic = critic_optim = None
    if cfg.critic.enable and with_critic:
        same_trunk = cfg.critic.model.path == arr.model.path  # the actor's config, read once
        critic, critic_optim = build_critic(cfg, ps, total_steps, model_args if same_trunk else None)
    reward = None
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        reward = _model(ps, load_model_args_any(rm.model.path), "reward", rm.model.path, rm.megatron).eval()
    return Models(actor, actor_optim, ref, critic, critic_optim, reward)


def park_for_generation(models: Models, cfg: Config, parking) -> None:
    """Before generation: park in host memory what the *.megatron.*_offload keys name (offload.HostParking);
    the actor's parameters are parked by the caller after the weight sync, which reads them."""
    arr, park = cfg.actor_rollout_ref, parking.park
    trained = [("actor", models.actor, models.actor_optim, arr.actor.megatron)]
    if models.critic is not None:
        trained.append(("critic", models.critic, models.critic_optim, cfg.critic.megatron))
    for name, model, optim, mcfg in trained:
        if mcfg.optimizer_offload:
            park(optim.state_tensors())
        if mcfg.grad_offload:
            park(optim.grad_tensors(), keep_values=False)
        if mcfg.param_offload and name != "actor":
            park(model.parameters())
    frozen = ((models.ref, arr.ref.megatron), (models.reward, cfg.reward_model.megatron))
    for model, mcfg in frozen:
        if model is not None and mcfg.param_offload:
            park(model.parameters())
