"""The actor, the reference policy and the advantage stage, as the loop sees them.

ActorRole.log_probs(step, batch, stats)   old log-probs [B, R] of the sampled tokens (rollout
                                          temperature), timed as timing_s/old_log_prob; None when
                                          the update's first forward gives them (docs/performance.md)
ActorRole.correct(batch)                  the rollout engine's log-probs against them: mismatch
                                          metrics and corrections (algorithm.rollout_correction);
                                          under R3 rollout_corr/router_mismatch; under R2 the
                                          old-log-prob pass records the routing the update replays
ActorRole.update(step, batch, stats)      the PPO update, after trainer.critic_warmup steps
ActorRole.model                           the module the reshard stream reads into the engines
ActorRole.register_state(registry)        actor/, actor_optim/ and the optimizer's counters
RefRole.log_probs(batch, stats)           the frozen reference's log-probs, or None when no KL term
                                          needs it (timing_s/ref)
Advantages(batch)                         KL-shaped token rewards (algorithm.use_kl_in_reward, the
                                          KL controller is checkpointed), the estimator's advantages
                                          and returns, then rollout rejection (timing_s/adv)
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ActorConfig, AlgorithmConfig, RolloutCorrectionConfig
from megatron_rl.config.specs import ActorSpec
from megatron_rl.microbatches import ForwardPasses, MicroBatching, TokenStats
from megatron_rl.mismatch import correct_mismatch, reject
from megatron_rl.models.lora import adapters_disabled
from megatron_rl.optim import NONFINITE_ADVANTAGES, count_nonfinite
from megatron_rl.parallel import ParallelState
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import StateRegistry

_TRAIN_ONLY_NOISE = ("hidden_dropout", "attention_dropout", "moe_input_jitter_eps")  # train-mode noise


def old_log_prob_is_first_forward(
    actor: ActorConfig,
    spec: ActorSpec,
    passes: ForwardPasses,
    batch_size: int,
    dp_size: int,
    step: int,
    model: torch.nn.Module | None = None,
) -> bool:
    """Whether step ``step``'s old-log-prob pass may be skipped (``batch.old_log_probs = None`` for
    ppo.update_actor): it would give exactly the update's first forward (ratio 1), and nothing reads
    it before the update. That holds when
    * the actor updates this step (``step > trainer.critic_warmup``) in one optimizer step over the
      rank's ``batch_size`` sequences in batch order: ``ppo_epochs == 1``, ``ppo_mini_batch_size x
      rollout.n / DP == batch_size``, ``actor.shuffle`` off;
    * both passes cut the same micro-batches: ``rollout.log_prob_micro_batch_size_per_gpu ==
      actor.ppo_micro_batch_size_per_gpu``, or dynamic batching on both with the same token budget;
    * the training forward has no noise: no dropout, no MoE input jitter (``model``'s TransformerConfig
      when given, else actor.megatron.override_transformer_config);
    ``spec`` gives the step's facts (config.specs.ActorSpec), ``passes`` the old-log-prob pass's
    micro-batching;
    * nothing consumes old_log_probs before the update: no ``algorithm.use_kl_in_reward``, no engine
      log-probs kept (``rollout.calculate_log_probs``, ``algorithm.rollout_correction.rollout_is`` /
      ``rollout_rs``, ``rollout.max_staleness > 0``: mismatch metrics, weights and rejection use them).
    """
    if step <= spec.critic_warmup or actor.ppo_epochs != 1 or actor.shuffle:
        return False
    if actor.ppo_mini_batch_size * spec.rollout_n != batch_size * dp_size:
        return False
    update = MicroBatching.of(
        actor.ppo_micro_batch_size_per_gpu,
        actor.use_dynamic_bsz,
        actor.ppo_max_token_len_per_gpu,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    )
    old = passes.old_log_prob
    dynamic = update.dynamic or old.dynamic
    if (update.max_tokens != old.max_tokens) if dynamic else (update.size != old.size):
        return False
    if model is not None:
        config = getattr(model, "module", model).config
        noise = {name: getattr(config, name, None) for name in _TRAIN_ONLY_NOISE}
    else:
        noise = {name: actor.megatron.override_transformer_config.get(name) for name in _TRAIN_ONLY_NOISE}
    if any(noise.values()):
        return False
    return not (spec.use_kl_in_reward or spec.keeps_engine_log_probs)


# --------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------


class ActorRole:
    """The trained policy on the training ranks (module docstring)."""

    def __init__(
        self,
        actor: ActorConfig,
        correction: RolloutCorrectionConfig,
        spec: ActorSpec,
        ps: ParallelState,
        model,
        optim,
        passes: ForwardPasses,
        timer: Timer,
    ) -> None:
        """``actor``: actor_rollout_ref.actor; ``correction``: algorithm.rollout_correction."""
        self.actor, self.correction, self.spec = actor, correction, spec
        self.ps, self.model, self.optim, self.passes, self.timer = ps, model, optim, passes, timer
        self._router_reported = False  # this step's router mismatch came from the old-log-prob pass

    def log_probs(self, step: int, batch: RolloutBatch, stats: TokenStats) -> torch.Tensor | None:
        """None when the pass would equal the update's first forward and nothing reads it before the
        update (old_log_prob_is_first_forward): the update then fills batch.old_log_probs itself."""
        from megatron_rl import ppo

        temperature = self.spec.temperature
        with self.timer("old_log_prob"):  # logged either way (0 s when skipped): the same metric keys
            # skipped, the update's first forward is the old-log-prob pass: R2 then has nothing to replay
            first = old_log_prob_is_first_forward
            if first(self.actor, self.spec, self.passes, len(batch), self.ps.dp_size, step, self.model):
                return None
            if self.actor.router_replay.mode != "R2":
                return ppo.compute_log_probs(
                    self.model, self.ps, batch, self.passes.old_log_prob, temperature, stats=stats
                )
            from megatron_rl.models import routing

            config = getattr(self.model, "module", self.model).config
            with routing.recording(self.model, config.num_layers, config.moe_router_topk) as rec:
                old = ppo.compute_log_probs(
                    self.model, self.ps, batch, self.passes.old_log_prob, temperature, stats=stats
                )
            batch.routed_experts = rec.routed_experts(
                self.ps, config.sequence_parallel
            )  # the updates replay it
            return old

    def correct(self, batch: RolloutBatch) -> dict[str, float]:
        """Mismatch metrics and corrections against the engine's log-probs (none kept: nothing to do),
        and with routing replay the share of routing the old-log-prob pass would have chosen otherwise."""
        metrics = self._router_mismatch()
        self._router_reported = bool(metrics)
        if batch.rollout_log_probs is None:
            return metrics
        with self.timer("rollout_corr"):
            return {
                **metrics,
                **correct_mismatch(batch, self.correction, self.ps.dp_group),
            }

    def _router_mismatch(self) -> dict[str, float]:
        """(token, layer) pairs whose own top-k differs from the replayed one, over the forwards since
        the last call (models/routing.py): ``rollout_corr/router_mismatch`` under R3 (the engine's),
        ``actor/router_mismatch`` under R2 (the old-log-prob pass's); collective."""
        mode = self.actor.router_replay.mode
        if mode == "disabled":
            return {}
        from megatron_rl.models.routing import mismatch_fraction, replays_of

        ps = self.ps
        frac = mismatch_fraction(replays_of(self.model), (ps.dp_group, ps.mp_group), ps.device)
        key = "rollout_corr/router_mismatch" if mode == "R3" else "actor/router_mismatch"
        return {} if frac is None else {key: frac}

    def update(self, step: int, batch: RolloutBatch, stats: TokenStats) -> dict[str, float]:
        """The PPO update of step ``step`` (mini-batches shuffled by the step); nothing during the
        trainer.critic_warmup steps."""
        from megatron_rl import ppo

        actor, spec = self.actor, self.spec
        if step <= spec.critic_warmup:
            return {}
        with self.timer("update_actor"):
            metrics = ppo.update_actor(
                self.model,
                self.optim,
                self.ps,
                batch,
                actor,
                spec.rollout_n,
                spec.temperature,
                shuffle_seed=step,
                stats=stats,
            )
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = actor.kl_loss_coef
        router = self._router_mismatch()  # the update's forwards; reported when no old-log-prob pass ran
        if not self._router_reported:
            metrics.update(router)
        return metrics

    def register_state(self, registry: StateRegistry) -> None:
        registry.register_model("actor", self.model, self.optim)


class RefRole:
    """The frozen reference policy (None: no KL term needs it); ``adapters_off``: ``model`` is the LoRA
    actor, run without its adapters (its base is the reference: no second copy of the weights)."""

    def __init__(
        self,
        temperature: float,
        ps: ParallelState,
        model,
        passes: ForwardPasses,
        timer: Timer,
        adapters_off: bool = False,
    ) -> None:
        """``temperature``: the rollout's (config.specs.ActorSpec.temperature)."""
        self.temperature, self.ps, self.model, self.passes, self.timer = temperature, ps, model, passes, timer
        self.adapters_off = adapters_off

    def log_probs(self, batch: RolloutBatch, stats: TokenStats) -> torch.Tensor | None:
        from megatron_rl import ppo

        if self.model is None:
            return None
        with self.timer("ref"), adapters_disabled(self.model) if self.adapters_off else nullcontext():
            return ppo.compute_log_probs(
                self.model, self.ps, batch, self.passes.ref, self.temperature, stats=stats
            )


class Advantages:
    """Token rewards, advantages and returns of a scored batch with its log-probs and values."""

    def __init__(self, algorithm: AlgorithmConfig, ps: ParallelState, timer: Timer) -> None:
        from megatron_rl.algos.kl import get_kl_controller
        from megatron_rl.algos.rollout_corr import parse_rs

        self.algorithm, self.ps, self.timer = algorithm, ps, timer
        kl, corr = algorithm.kl_ctrl, algorithm.rollout_correction
        self.kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.rejection = parse_rs(corr.rollout_rs, corr.rollout_rs_threshold) if corr.rollout_rs else None

    def register_state(self, registry: StateRegistry) -> None:
        registry.register("kl_ctrl", self.kl_ctrl)

    def __call__(self, batch: RolloutBatch) -> dict[str, float]:
        with self.timer("adv"):
            metrics = self._advantages(batch)
            if self.rejection is not None:
                metrics.update(reject(batch, self.rejection, self.ps.dp_group))
        return metrics

    def _advantages(self, batch: RolloutBatch) -> dict[str, float]:
        from megatron_rl.algos import advantages as adv
        from megatron_rl.algos.kl import apply_kl_penalty

        alg, ps = self.algorithm, self.ps
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            scores, old, ref = batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs
            # the stages before: rewards, the actor's log-probs, the reference's (use_kl_in_reward builds it)
            assert scores is not None and old is not None and ref is not None
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                scores,
                old,
                ref,
                batch.response_mask,
                self.kl_ctrl,
                alg.kl_penalty,
                group=ps.dp_group,
            )
            metrics.update(kl_metrics)
        else:
            batch.token_level_rewards = batch.token_level_scores
        # Each estimator takes the subset of these it needs (gae: values; the outcome ones: the groups).
        available = {
            "token_level_rewards": batch.token_level_rewards,
            "response_mask": batch.response_mask,
            "values": batch.values,
            "index": [mt.uid for mt in batch.meta],
            "gamma": alg.gamma,
            "lam": alg.lam,
            "norm_adv_by_std_in_grpo": alg.norm_adv_by_std_in_grpo,
            "group": ps.dp_group,  # whitening over every data-parallel rank
        }
        estimator = adv.get_adv_estimator(alg.adv_estimator)
        wanted = inspect.signature(estimator).parameters
        batch.advantages, batch.returns = estimator(**{k: v for k, v in available.items() if k in wanted})
        bad = count_nonfinite(batch.advantages, batch.response_mask, ps.dp_group)
        metrics[NONFINITE_ADVANTAGES] = float(bad)  # read by the NonFiniteGuard after the update
        return metrics
