"""Building a run's roles on the training ranks, in the order memory wants (roles/__init__ maps them):

    build_roles(cfg, specs, ps, placement, ...)    specs: config.specs.resolve, the facts each role reads
      -> colocated rollout: the engine first, on an empty GPU (start_engine), so that
         rollout.gpu_memory_utilization is the share of the whole GPU it takes
      -> the models: actor (+ optimizer), ref, critic (+ optimizer, handed to the critic role), reward
      -> ActorRole, RefRole, the critic role (NullCritic | LocalCritic | RemoteCritic), Advantages,
         the rollout role (ColocatedRollout | SeparateRollout), the reward source (a reward model
         replaces the rules once it exists)
      -> every role registers its checkpoint state (run.state.StateRegistry) here, once

A new role is built here and registers its state here; the trainer only calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.config import Config
from megatron_rl.config.placement import Placement
from megatron_rl.config.specs import Specs
from megatron_rl.microbatches import ForwardPasses
from megatron_rl.parallel import ParallelState
from megatron_rl.reward.source import RewardSource
from megatron_rl.roles.actor import ActorRole, Advantages, RefRole
from megatron_rl.roles.critic import CriticRole, make_critic
from megatron_rl.roles.models import Models, build_models, park_for_generation
from megatron_rl.roles.rollout import (
    ColocatedRollout,
    RolloutData,
    RolloutRole,
    SeparateRollout,
    start_engine,
)
from megatron_rl.roles.rollout.generators import make_generator
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import StateRegistry


@dataclass
class Roles:
    models: Models
    """The actor's, ref's and reward model's modules (perf metrics read them); the critic's are the
    critic role's."""
    actor: ActorRole
    ref: RefRole
    critic: CriticRole
    advantages: Advantages
    rollout: RolloutRole
    reward: RewardSource

    def shutdown(self) -> None:
        """Stop the engines (and the servers on ranks of their own)."""
        try:
            self.rollout.shutdown()
        finally:
            self.critic.shutdown()


def build_roles(
    cfg: Config,
    specs: Specs,
    ps: ParallelState,
    placement: Placement,
    model_args,
    data: RolloutData,
    total_steps: int,
    draw: Callable[[], list[int]],
    reward: RewardSource,
    tokenizer,
    timer: Timer,
    registry: StateRegistry,
) -> Roles:
    """The roles of the training ranks (module docstring); ``draw()``: this rank's next prompt indices;
    ``reward``: the rule / custom / server reward source (a reward model replaces it)."""
    from megatron_rl.reward.scoring import make_reward_fn
    from megatron_rl.run.memory_plan import plan_memory

    passes = ForwardPasses.from_config(cfg)
    engine = None if placement.separate_rollout else start_engine(cfg, ps, model_args)
    models, critic_built = build_models(
        cfg, ps, model_args, total_steps, with_critic=not placement.separate_critic
    )
    critic = make_critic(
        cfg.critic, specs.critic, ps, critic_built, placement.separate_critic, total_steps, data.pad_id,
        passes, timer,
    )  # fmt: skip
    arr = cfg.actor_rollout_ref
    actor = ActorRole(
        arr.actor,
        cfg.algorithm.rollout_correction,
        specs.actor,
        ps,
        models.actor,
        models.actor_optim,
        passes,
        timer,
    )
    if models.reward is not None:
        reward = make_reward_fn(cfg, tokenizer, ps, models.reward)
    if engine is not None:
        # what to park while the engine generates: decided once, from this rank's memory (run/memory_plan)
        plan = plan_memory(
            cfg,
            ps.device,
            trained={"actor": (models.actor, models.actor_optim), "critic": (critic.model, critic.optim)},
            frozen={"ref": models.ref, "reward": models.reward},
            log=(lambda line: print(line, flush=True)) if ps.rank == 0 else None,
        )
        rollout: RolloutRole = ColocatedRollout(
            arr.rollout,
            specs.rollout,
            ps,
            data,
            models.actor,
            lambda parking: park_for_generation(models, critic, cfg, parking, plan),
            engine,
            draw,
            make_generator(cfg, ps, tokenizer),  # the engine alone, or multi-turn episodes: chosen once
            plan,
            new_engine=lambda: start_engine(cfg, ps, model_args),
        )
    else:
        rollout = SeparateRollout(
            arr.rollout,
            specs.rollout,
            cfg.data.tokenizer,
            ps,
            data,
            models.actor,
            placement,
            draw,
            total_steps,
        )
    roles = Roles(
        models,
        actor,
        ref_role(specs, ps, models, passes, timer),
        critic,
        Advantages(cfg.algorithm, ps, timer),
        rollout,
        reward,
    )
    actor.register_state(registry)
    critic.register_state(registry)
    roles.advantages.register_state(registry)
    rollout.register_state(registry)
    return roles


def ref_role(specs: Specs, ps: ParallelState, models: Models, passes: ForwardPasses, timer: Timer) -> RefRole:
    """The reference policy when a KL term needs one: its own frozen model, or with LoRA (no reference
    weights built) the actor without its adapters; else none."""
    temperature = specs.actor.temperature
    if specs.ref.adapters_off:
        return RefRole(temperature, ps, models.actor, passes, timer, adapters_off=True)
    return RefRole(temperature, ps, models.ref, passes, timer)


@dataclass
class RunInputs:
    """The tokenizer, the actor's model config and the prompts of a run (read before any model)."""

    tokenizer: object
    model_args: object
    data: RolloutData
    sampler: object
    """data.ResumableDistributedSampler over the training prompts (this DP rank's share)."""
    total_steps: int


def read_inputs(cfg: Config, specs: Specs, ps: ParallelState) -> RunInputs:
    """The run's inputs; one line naming the key for a tokenizer, data or batch size that cannot work.
    Rewards by the rules (``specs.reward``): every row's data_source and ground truth are checked now."""
    from transformers import AutoTokenizer

    from megatron_rl.config import ConfigError
    from megatron_rl.data import PromptDataset, ResumableDistributedSampler
    from megatron_rl.model_args import check_sliding_window
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.reward.rules import RULE_DATA_SOURCES
    from megatron_rl.rollout.agent.tools import prompt_tool_schemas
    from megatron_rl.rollout.base import stop_token_ids

    arr = cfg.actor_rollout_ref
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.data.tokenizer, trust_remote_code=arr.model.trust_remote_code
        )
    except (OSError, ValueError) as e:  # e.g. a Megatron checkpoint without tokenizer files
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer}: no usable tokenizer there ({why}); "
            "set data.tokenizer to the HF model directory the checkpoint came from."
        ) from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model_args = load_model_args_any(arr.model.path)
    stop_ids = stop_token_ids(tokenizer, [d for d in (arr.model.path, cfg.data.tokenizer) if d])
    # Full causal attention equals the model's sliding window only for sequences within the window.
    check_sliding_window(
        model_args, cfg.data.max_prompt_length + cfg.data.max_response_length, arr.model.path
    )
    tool_schemas = prompt_tool_schemas(arr.rollout.multi_turn)

    def dataset(files):
        return PromptDataset(
            files,
            tokenizer,
            cfg.data.max_prompt_length,
            truncation=cfg.data.truncation,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
            prompt_key=cfg.data.prompt_key,
            rule_sources=RULE_DATA_SOURCES if specs.reward.by_rule else None,
            tools=tool_schemas,  # multi-turn: the chat template shows the tools
        )

    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty: give one or more verl-format parquet files.")
    train = dataset(cfg.data.train_files)
    val = dataset(cfg.data.val_files) if cfg.data.val_files else None
    sampler = ResumableDistributedSampler(
        len(train),
        cfg.data.train_batch_size,
        ps.dp_rank,
        ps.dp_size,
        cfg.data.seed,
        shuffle=cfg.data.shuffle,
        group_size=arr.rollout.n,
    )
    if len(sampler) == 0:
        raise ValueError(
            f"data.train_batch_size={cfg.data.train_batch_size} exceeds the {len(train)} training prompts."
        )
    total_steps = cfg.trainer.total_training_steps or len(sampler) * cfg.trainer.total_epochs
    data = RolloutData(train, val, pad_id, stop_ids, specs.rollout.keeps_log_probs)
    return RunInputs(tokenizer, model_args, data, sampler, total_steps)
