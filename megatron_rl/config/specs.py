"""The config resolved once: after validation, the facts each role reads, as frozen per-role specs.

    cfg = load_config(path, overrides)        # keys and their derived defaults (config.load)
    validate(cfg, world_size)                 # the combinations
    specs = resolve(cfg, device, dp_size)     # Specs: actor, ref, critic, rollout, reward

A fact that several keys decide together is computed here and read everywhere else from its spec:

=========================  ============================================  ==================================
fact                       decided by                                    read by
=========================  ============================================  ==================================
engine log-probs kept      rollout.calculate_log_probs, the rollout      the rollout (sampling params), the
                           correction's rollout_is / rollout_rs,         actor (old-log-prob pass never
                           rollout.max_staleness > 0                     skipped while they are kept)
reference needed           actor.use_kl_loss, algorithm.use_kl_in_reward  the ref role, the model builder
reward source              reward_model.enable / http.url,               the trainer (rule rows checked at
                           custom_reward_function.path, else the rules   load), scoring
engine dtype               rollout.dtype, the device (CPU runs float32:  the sync probe (the engines and
                           model_args.run_dtype, for the models too)     builders call run_dtype)
an update's clip bounds    actor: clip_ratio[_low/_high]; critic:        ppo_loop.UpdatePlan for
and loss scale             cliprange_value; loss_agg_mode and            ppo.update_actor / update_critic
                           loss_scale_factor (data.max_response_length   (one :class:`UpdateSpec` shape for
                           when unset, never a batch's width)            both roles)
samples per drawn prompt   rollout.n, data.train_batch_size, DP size     the rollout's sampling and queue
=========================  ============================================  ==================================

The specs are frozen: a role cannot change a fact another role reads. Each holds what its role reads
beyond its own config section, so a role takes its section and its spec, not the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_rl.config.errors import ConfigError
from megatron_rl.model_args import run_dtype

if TYPE_CHECKING:
    import torch

    from megatron_rl.config.schema import ActorConfig, Config, CriticConfig

RewardKind = Literal["rules", "function", "http", "model"]


def needs_reference(cfg: Config) -> bool:
    """Whether a KL term reads the reference policy's log-probs (the KL loss, or the KL penalty in the
    reward): its own frozen model then, or with LoRA the actor without its adapters."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def keeps_engine_log_probs(cfg: Config) -> bool:
    """Whether the rollout keeps the engine's log-probs of the sampled tokens: asked for
    (``rollout.calculate_log_probs``), needed by the rollout correction (``rollout_is`` /
    ``rollout_rs``), or always with ``rollout.max_staleness > 0`` (the behaviour policy is then older
    than the trainer's actor). The mismatch metrics and corrections read them, so the old-log-prob pass
    is never skipped while they are kept."""
    rollout, corr = cfg.actor_rollout_ref.rollout, cfg.algorithm.rollout_correction
    return bool(
        rollout.calculate_log_probs or corr.rollout_is or corr.rollout_rs or rollout.max_staleness > 0
    )


def reward_kind(cfg: Config) -> RewardKind:
    """Which reward source scores the rollouts (config.checks refuses two at once)."""
    rm = cfg.reward_model
    if rm.enable:
        return "model"
    if rm.http.url:
        return "http"
    return "function" if cfg.custom_reward_function.path else "rules"


@dataclass(frozen=True)
class UpdateSpec:
    """What one PPO update reads beyond its micro-batching: the same shape for the actor and the critic."""

    key: str
    """The config section, as errors name it (``actor_rollout_ref.actor``, ``critic``)."""
    loss_agg_mode: str
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale: float
    """seq-mean-token-sum-norm's constant: ``loss_scale_factor``, data.max_response_length when unset
    (config.load.fill_update_defaults): the same on every DP rank and placement, never a batch's width."""
    clip_low: float
    """The ratio's lower clip range (actor: clip_ratio_low, clip_ratio when unset); the critic's value
    clip (cliprange_value) on both sides."""
    clip_high: float
    """The upper clip range (actor: clip_ratio_high, clip_ratio when unset; critic: cliprange_value)."""

    @classmethod
    def of(cls, section: ActorConfig | CriticConfig, key: str) -> UpdateSpec:
        """The spec of a loaded section (load_config fills the derived keys; unset ones are refused)."""
        from megatron_rl.config.schema import CriticConfig

        if section.loss_scale_factor is None:
            raise ConfigError(f"{key}.loss_scale_factor is unset: load the config with load_config")
        if isinstance(section, CriticConfig):
            low = high = section.cliprange_value
        else:
            if section.clip_ratio_low is None or section.clip_ratio_high is None:
                raise ConfigError(
                    f"{key}.clip_ratio_low / clip_ratio_high are unset: load the config with load_config"
                )
            low, high = section.clip_ratio_low, section.clip_ratio_high
        return cls(key, section.loss_agg_mode, float(section.loss_scale_factor), low, high)


@dataclass(frozen=True)
class ActorSpec:
    rollout_n: int
    """Samples per prompt (rollout.n): mini-batches count sequences in prompts x n."""
    temperature: float
    """The rollout's sampling temperature: every log-prob pass and the update divide logits by it."""
    critic_warmup: int
    """Steps before the actor's first update (trainer.critic_warmup)."""
    keeps_engine_log_probs: bool
    """The engine's log-probs are kept: the old-log-prob pass always runs (they are compared with it)."""
    use_kl_in_reward: bool
    """The reward's KL penalty reads the old log-probs before the update."""


@dataclass(frozen=True)
class RefSpec:
    adapters_off: bool
    """LoRA: the reference is the actor with its adapters off (no reference weights built)."""


@dataclass(frozen=True)
class CriticSpec:
    enabled: bool
    """critic.enable (resolved: on with GAE)."""
    rollout_n: int
    """Samples per prompt (rollout.n): mini-batches count sequences in prompts x n."""
    dist_timeout_minutes: float
    """How long a wait for a critic on ranks of its own may take (trainer.dist_timeout_minutes)."""


@dataclass(frozen=True)
class RolloutSpec:
    dtype: str
    """The engine's dtype on this device."""
    keeps_log_probs: bool
    """The engine returns each sampled token's log-prob and the batch keeps them."""
    samples_per_draw: int
    """Samples each prompt the sampler hands a rank stands for (config.batch_sizes.samples_per_draw)."""
    max_new_tokens: int
    """A response's budget: data.max_response_length (model and tool tokens alike)."""
    routed_experts: bool
    """Routing replay R3: training rollouts return each token's experts."""
    dist_timeout_minutes: float
    """How long a wait on the engines' ranks may take (trainer.dist_timeout_minutes)."""
    partial_quota: int = 0
    """Partial rollouts: the groups a step trains on per DP rank (data.train_batch_size / DP); 0: off."""
    partial_slots: int = 0
    """Partial rollouts: prompts this DP rank keeps in flight (rollout.partial_rollout_window x the
    quota, rounded, at least one more than the quota); 0: off."""


@dataclass(frozen=True)
class RewardSpec:
    kind: RewardKind

    @property
    def by_rule(self) -> bool:
        """The rules score: every row's data_source and ground truth are checked when the data loads."""
        return self.kind == "rules"


@dataclass(frozen=True)
class Specs:
    actor: ActorSpec
    ref: RefSpec
    critic: CriticSpec
    rollout: RolloutSpec
    reward: RewardSpec


def resolve(cfg: Config, device: torch.device | str, dp_size: int = 1) -> Specs:
    """The run's specs on ``device`` for ``dp_size`` training DP ranks (module docstring); ``cfg``
    loaded and validated."""
    from megatron_rl.config.batch_sizes import samples_per_draw

    arr = cfg.actor_rollout_ref
    if arr.rollout.dtype is None:  # config.load fills it with the actor's params_dtype
        raise ConfigError("actor_rollout_ref.rollout.dtype is unset: load the config with load_config")
    keeps = keeps_engine_log_probs(cfg)
    return Specs(
        actor=ActorSpec(
            rollout_n=arr.rollout.n,
            temperature=arr.rollout.temperature,
            critic_warmup=cfg.trainer.critic_warmup,
            keeps_engine_log_probs=keeps,
            use_kl_in_reward=cfg.algorithm.use_kl_in_reward,
        ),
        ref=RefSpec(adapters_off=needs_reference(cfg) and bool(arr.model.lora.rank)),
        critic=CriticSpec(bool(cfg.critic.enable), arr.rollout.n, cfg.trainer.dist_timeout_minutes),
        rollout=RolloutSpec(
            dtype=run_dtype(arr.rollout.dtype, device),
            keeps_log_probs=keeps,
            samples_per_draw=samples_per_draw(cfg, dp_size),
            max_new_tokens=cfg.data.max_response_length,
            routed_experts=arr.actor.router_replay.mode == "R3",
            dist_timeout_minutes=cfg.trainer.dist_timeout_minutes,
            partial_quota=cfg.data.train_batch_size // dp_size if arr.rollout.partial_rollout else 0,
            partial_slots=(
                max(
                    cfg.data.train_batch_size // dp_size + 1,
                    round(arr.rollout.partial_rollout_window * cfg.data.train_batch_size / dp_size),
                )
                if arr.rollout.partial_rollout
                else 0
            ),
        ),
        reward=RewardSpec(reward_kind(cfg)),
    )
