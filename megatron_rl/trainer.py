"""The PPO loop. ``Trainer.step`` runs one step on every training rank, stage by stage, each stage one
call to a role (megatron_rl.roles, built by roles.build.build_roles):

1. Rollout and rewards (reward.refill.scored_batch): the rollout role turns this rank's prompts into a
   RolloutBatch -- colocated, it parks the training state in host memory (*.megatron.*_offload keys),
   syncs the actor's weights into the engine (timing_s/reshard), generates rollout.n responses per
   prompt (timing_s/gen) and reloads the state; on ranks of its own, it waits for the generations it
   asked for (up to rollout.max_staleness steps ahead). Each row carries the policy version that
   sampled it. The reward source scores them (timing_s/reward); with algorithm.filter_groups groups
   whose samples all score the same are dropped and more prompts generated.
2. Every trainer.sync_check_freq steps, the engine's log-probs are checked against the actor's
   (roles.sync_check, timing_s/sync_check).
3. The critic role starts on the values (a critic on ranks of its own computes them meanwhile), the
   actor role computes the old log-probs (timing_s/old_log_prob; skipped when the update's first forward
   gives them: one mini-batch, one epoch, the same micro-batches) and checks them against the engine's
   (algorithm.rollout_correction), the reference role its log-probs (timing_s/ref); then the values are
   waited for (timing_s/values). GRPO and the other outcome estimators have a NullCritic: no values.
4. Advantages (roles.actor.Advantages): KL-shaped token rewards, the estimator, rollout rejection
   (timing_s/adv).
5. The critic update is started, the actor updates (after trainer.critic_warmup; timing_s/update_actor),
   the critic's metrics are waited for (timing_s/update_critic).
6. The rollout role learns of the new policy: colocated, the engine is stale until the next sync;
   separate, the weights are streamed and step + 1 + max_staleness is asked for.
7. Metrics (data, staleness, perf). After the step ``fit`` validates every trainer.test_freq steps
   (reward.scoring.validation_metrics) and saves every trainer.save_freq (timing_s/save_checkpoint).

Checkpoints go through one registry (run.state.StateRegistry): the sampler and the training data's
fingerprint are registered here, each role registers its own state in build_roles; save and resume walk
it. A new piece of state is registered once where its owner is built.

The engine holds GPU memory only while it generates (colocated hybrid engine): it is resumed before
generation and released right after; with the offload keys on, the training state is in host memory
during that time, so the two never hold the GPU at once. Sampling is seeded by (seed, step): with the
transformers engine a resumed run repeats the same rollouts; SGLang honours per-request seeds only in its
deterministic-inference mode (not enabled here), so there a resumed run draws new samples from the same
policy.
"""

from __future__ import annotations

import logging
import os
import time

from megatron_rl.config import Config, ConfigError, resolve, to_dict
from megatron_rl.config.placement import Placement, resolve_placement
from megatron_rl.microbatches import TokenStats
from megatron_rl.optim import NonFiniteGuard
from megatron_rl.parallel import ParallelState
from megatron_rl.reward.refill import scored_batch
from megatron_rl.reward.scoring import make_reward_fn, validation_metrics
from megatron_rl.roles.build import build_roles, read_inputs
from megatron_rl.roles.sync_check import SyncProbe
from megatron_rl.run.checkpoint import CheckpointManager
from megatron_rl.run.metrics import (
    MetricsLogger,
    Timer,
    data_metrics,
    progress_bar,
    write_config_record,
    write_summary,
)
from megatron_rl.run.perf import measure_peak_flops, perf_metrics
from megatron_rl.run.state import StateRegistry, Value

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, ps: ParallelState, placement: Placement | None = None) -> None:
        self.cfg, self.ps = cfg, ps
        self.placement = placement or resolve_placement(cfg, ps.world_size)
        specs = resolve(cfg, ps.device, ps.dp_size)  # the facts each role reads, decided once
        inputs = read_inputs(cfg, specs, ps)
        self.tokenizer, self.model_args, self.data = inputs.tokenizer, inputs.model_args, inputs.data
        self.sampler, self.total_steps = inputs.sampler, inputs.total_steps
        # The rules, a custom function (imported now: a broken file fails before any model is built) or
        # a reward server; a reward model replaces it once the models exist.
        reward = make_reward_fn(cfg, self.tokenizer)
        # The output directory is this run's before anything heavy is built: rank 0 locks it.
        t = cfg.trainer
        dirs = (cfg.data.tokenizer, cfg.actor_rollout_ref.model.path)
        self.ckpt = CheckpointManager(
            t.default_local_dir, ps, t.max_ckpt_to_keep, dirs, t.checkpoint_permissions, claim=True
        )
        self.state = StateRegistry()
        self.state.register("sampler", self.sampler)
        self.state.register("train_data", Value(self.data.train.fingerprint(), self._check_same_data))
        self._batches = iter(self.sampler)
        self.timer = Timer(ps.device)
        self.roles = build_roles(
            cfg,
            specs,
            ps,
            self.placement,
            self.model_args,
            self.data,
            self.total_steps,
            lambda: next(self._batches),
            reward,
            self.tokenizer,
            self.timer,
            self.state,
        )
        self.sync_probe = SyncProbe(cfg, specs.rollout, ps, self.data)
        self.logger = MetricsLogger(
            t.logger,
            t.log_dir,
            t.project_name,
            t.experiment_name,
            to_dict(cfg),
            enabled=ps.rank == 0,
            block_freq=t.console_block_freq,
        )
        self.global_step = 0
        self.nonfinite = NonFiniteGuard(t.max_nonfinite_steps, log if ps.rank == 0 else None)
        self.peak_flops = measure_peak_flops(ps.device)

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        """Resume (trainer.resume_mode), then train to the last step; a stop signal ends the loop after
        the current step with a checkpoint and :class:`~megatron_rl.run.lifecycle.Preempted`."""
        from megatron_rl.run.lifecycle import REPLACE, Preempted, PreemptionWatch

        self.global_step, resumed_row = self.state.resume(self.ckpt, self.cfg.trainer, self.ps.rank)
        self.roles.rollout.start(self.global_step)  # separate rollout: weights out, next steps asked for
        cfg, last = self.cfg.trainer, {}
        if self.global_step >= self.total_steps > 0:
            if self.ps.rank == 0:
                print(
                    f"megatron-rl: the checkpoint in {cfg.default_local_dir} is at step {self.global_step}, "
                    f"the run's last step ({self.total_steps}): nothing to train. For a new run set "
                    "trainer.resume_mode=disable or another trainer.default_local_dir; to train longer, "
                    "raise trainer.total_training_steps or trainer.total_epochs.",
                    flush=True,
                )
            return last
        self.logger.begin(self.global_step)
        self.logger.replay(self.global_step, resumed_row)
        if self.ps.rank == 0:
            write_config_record(self.cfg, fresh=self.global_step == 0)
        has_val = self.data.val is not None
        if has_val and (cfg.val_only or (cfg.val_before_train and self.global_step == 0)):
            self.logger.log(self.global_step, self.validate())
        if cfg.val_only:  # verl's trainer.val_only: validate, train nothing
            return last
        bar = progress_bar(
            self.total_steps, self.global_step, enabled=self.ps.rank == 0 and "console" in cfg.logger
        )
        # SIGTERM / SIGINT / SIGUSR2 only set a flag; after each step (and its save) every rank agrees
        # on it, so all save the same step and leave together (megatron_rl.run.lifecycle).
        with PreemptionWatch() as watch:
            while self.global_step < self.total_steps:
                self.global_step += 1
                last = self.step(
                    self.roles.rollout.prompts(self.global_step), more=lambda: next(self._batches)
                )
                if has_val and cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0:
                    last.update(self.validate())
                is_last = self.global_step == self.total_steps
                saved = None
                if (cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0) or (
                    is_last and cfg.save_at_end
                ):
                    with self.timer("save_checkpoint"):
                        saved = self.save(last)
                    last.update(self.timer.pop())
                self.logger.log(self.global_step, last, echo=bar.write, last=is_last)
                bar.update(1)
                if not is_last and watch.requested(device=self.ps.device):
                    saved = saved or self.save()
                    bar.close()
                    self.logger.close()
                    if self.ps.rank == 0:
                        again = "" if cfg.resume_mode == "auto" else " and trainer.resume_mode=auto"
                        then = f"resume with the same command{again}"
                        if watch.signum == REPLACE:
                            then = "launch/torchrun.sh restarts the job with trainer.placement.file read anew"
                        print(
                            f"megatron-rl: received {watch.signal_name} at step {self.global_step}; saved "
                            f"{saved}; exiting ({then})",
                            flush=True,
                        )
                    raise Preempted(watch.exit_code)
        bar.close()
        self.logger.close()
        if self.ps.rank == 0:
            write_summary(self.cfg, self.global_step, last, self.ckpt.latest(), self.logger.jsonl_path)
        return last

    def step(self, prompt_indices: list[int], more=None) -> dict[str, float]:
        """One PPO step on this rank's prompts (module docstring); ``more()`` gives the next prompts when
        DAPO's group filter (algorithm.filter_groups) needs to refill the batch."""
        cfg, ps, r, timer, step = self.cfg, self.ps, self.roles, self.timer, self.global_step
        t_step, metrics, tokens = time.perf_counter(), {}, TokenStats()  # tokens: perf/padding_fraction

        batch = scored_batch(
            lambda idx: r.rollout.batch(step, idx, timer),
            prompt_indices,
            more,
            r.reward,
            ps,
            cfg,
            self.data.pad_id,
            timer,
            metrics,
        )
        metrics.update(r.rollout.step_metrics(step))
        with timer("metrics"):
            metrics.update(r.rollout.staleness_metrics(batch))
        metrics.update(self.sync_probe.maybe_run(step, r.rollout, r.actor, timer))
        values = r.critic.values_async(step, batch, tokens)  # on ranks of its own: computed meanwhile
        batch.old_log_probs = r.actor.log_probs(step, batch, tokens)  # None: the update's forward
        metrics.update(r.actor.correct(batch))
        batch.ref_log_probs = r.ref.log_probs(batch, tokens)
        batch.values = values.result()
        metrics.update(r.advantages(batch))
        critic_update = r.critic.update_async(step, batch, tokens)  # on ranks of its own: meanwhile
        metrics.update(r.actor.update(step, batch, tokens))
        metrics.update(critic_update.result())
        r.rollout.policy_updated(step, timer)  # the engines get version `step`

        with timer("metrics"):
            self.nonfinite.check(metrics, step, self.ckpt.latest)
            metrics.update(
                data_metrics(batch, cfg.data.max_prompt_length, cfg.data.max_response_length, ps.dp_group)
            )
            # padded tokens / tokens processed by old_log_prob, ref, values and both updates
            metrics["perf/padding_fraction"] = tokens.padding_fraction(ps.dp_group, ps.device)
        metrics.update(timer.pop())
        metrics["timing_s/step"] = metrics["perf/time_per_step"] = time.perf_counter() - t_step
        metrics.update(
            perf_metrics(
                cfg,
                ps,
                self.model_args,
                r.critic.model.args if r.critic.model is not None else None,
                [o for o in (r.models.actor_optim, r.critic.optim) if o is not None],
                batch,
                metrics,
                self.peak_flops,
                timer,
                self.placement.world_size,
            )
        )
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.sampler.drawn_epoch  # the newest prompts' (refills included)
        return metrics

    def validate(self) -> dict[str, float]:
        """Every validation prompt once, scored under verl's names (reward.scoring.validation_metrics)."""
        r, scratch = self.roles, Timer(self.ps.device)
        with self.timer("testing"):
            out = validation_metrics(
                lambda idx: r.rollout.batch(self.global_step, idx, scratch, validate=True),
                r.reward,
                len(self.data.val),
                self.ps,
                self.cfg,
            )
        out.update(self.timer.pop())
        return out

    # ------------------------------------------------------------------------------------------ checkpoints

    def save(self, row: dict[str, float] | None = None) -> str:
        """``row``: the step's metrics (without the save's own time), kept in the checkpoint so that a
        death between publishing it and writing the row loses no row (run.metrics.MetricsLogger.replay)."""
        path = self.state.save(self.ckpt, self.global_step, extra={"metrics_row": row})
        if self.ps.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def _check_same_data(self, saved: str, path: str) -> None:
        """Resuming continues the sampler's position in the same prompts: other prompts (even as many)
        would be skipped or repeated without a word, so they stop the run in one line."""
        if saved != self.data.train.fingerprint():
            raise ConfigError(
                f"data.train_files={self.cfg.data.train_files} hold other prompts than the run that wrote "
                f"{path}; resuming would skip or repeat prompts. Restore the files, or start a new run from "
                f"those weights: actor_rollout_ref.model.path={os.path.join(path, 'actor')} with "
                "trainer.resume_mode=disable (or another trainer.default_local_dir)."
            )
