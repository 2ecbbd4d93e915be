"""The PPO loop. One step, on every rank:

    prompts (this DP rank's shard)
      -> park training state in host memory (*.megatron.*_offload keys)    timing_s/offload
      -> sync actor weights into the rollout engine (reshard stream)      timing_s/reshard
      -> generate rollout.n responses per prompt, reload the parked state  timing_s/gen, offload
      -> rule rewards on the decoded responses                             timing_s/reward
      -> old log-probs (actor), ref log-probs, values (critic)             timing_s/old_log_prob, ref, values
      -> KL-shaped token rewards, advantages                               timing_s/adv
      -> critic update, actor update (after trainer.critic_warmup)         timing_s/update_critic, _actor
      -> new weights to the engines (separate rollout: then ask for step+1+max_staleness)  timing_s/reshard
      -> metrics; validation every test_freq; checkpoint every save_freq   timing_s/save_checkpoint

The first three lines are the colocated rollout role (rollouts.ColocatedRollout); with
trainer.placement.rollout on ranks of its own (rollouts.SeparateRollout) generation runs there, up to
rollout.max_staleness steps ahead, and the step only waits for it (timing_s/gen). Likewise the critic
role (critic_role): with trainer.placement.critic on ranks of its own, values and the critic update
run there while the actor computes log-probs and updates, and timing_s/values, update_critic are the
actor's waits for it.

The engine holds GPU memory only while it generates (colocated hybrid engine): it is resumed before
generation and released right after; with the offload keys on, the training state is in host memory
during that time, so the two never hold the GPU at once. Sampling is seeded by (seed, step): with the
transformers engine a resumed run repeats the same rollouts; SGLang honours per-request seeds only in its
deterministic-inference mode (not enabled here), so there a resumed run draws new samples from the same
policy.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config, ConfigError, to_dict
from megatron_rl.config.placement import Placement, resolve_placement
from megatron_rl.errors import CheckpointError
from megatron_rl.microbatches import ForwardPasses, TokenStats
from megatron_rl.mismatch import correct_mismatch, reject
from megatron_rl.optim import NONFINITE_ADVANTAGES, NonFiniteGuard, count_nonfinite
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.critic import LocalCritic, RemoteCritic
from megatron_rl.roles.models import build_models
from megatron_rl.roles.rollout import ColocatedRollout, SeparateRollout
from megatron_rl.roles.sync_check import SyncProbe
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.reshard import WeightSyncError
from megatron_rl.run.metrics import (
    MetricsLogger,
    Timer,
    data_metrics,
    progress_bar,
    write_config_record,
    write_summary,
)
from megatron_rl.run.perf import measure_peak_flops, perf_metrics

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, ps: ParallelState, placement: Placement | None = None) -> None:
        from transformers import AutoTokenizer

        from megatron_rl.algos.kl import get_kl_controller
        from megatron_rl.algos.rollout_corr import parse_rs
        from megatron_rl.data import PromptDataset, ResumableDistributedSampler
        from megatron_rl.model_args import check_sliding_window
        from megatron_rl.models.loading import load_model_args_any
        from megatron_rl.reward.rules import RULE_DATA_SOURCES
        from megatron_rl.reward.scoring import make_reward_fn
        from megatron_rl.rollout.base import stop_token_ids
        from megatron_rl.rollout.tools import prompt_tool_schemas
        from megatron_rl.run.checkpoint import CheckpointManager

        self.cfg, self.ps = cfg, ps
        self.placement = placement or resolve_placement(cfg, ps.world_size)
        arr = cfg.actor_rollout_ref
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                cfg.data.tokenizer, trust_remote_code=arr.model.trust_remote_code
            )
        except (OSError, ValueError) as e:  # e.g. a Megatron checkpoint without tokenizer files
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"data.tokenizer={cfg.data.tokenizer}: no usable tokenizer there ({why}); "
                "set data.tokenizer to the HF model directory the checkpoint came from."
            ) from None
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.model_args = load_model_args_any(arr.model.path)
        self.stop_ids = stop_token_ids(self.tokenizer, (arr.model.path, cfg.data.tokenizer))
        # Full causal attention equals the model's sliding window only for sequences within the window.
        check_sliding_window(
            self.model_args, cfg.data.max_prompt_length + cfg.data.max_response_length, arr.model.path
        )
        tool_schemas = prompt_tool_schemas(arr.rollout.multi_turn)

        def dataset(files):
            return PromptDataset(
                files,
                self.tokenizer,
                cfg.data.max_prompt_length,
                truncation=cfg.data.truncation,
                filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                prompt_key=cfg.data.prompt_key,
                # built-in rules: every row's data_source and ground truth are checked up front
                rule_sources=None if self._rewards_not_by_rule() else RULE_DATA_SOURCES,
                tools=tool_schemas,  # multi-turn: the chat template shows the tools
            )

        if not cfg.data.train_files:
            raise ValueError("data.train_files is empty: give one or more verl-format parquet files.")
        self.train_data = dataset(cfg.data.train_files)
        self.val_data = dataset(cfg.data.val_files) if cfg.data.val_files else None
        self.sampler = ResumableDistributedSampler(
            len(self.train_data),
            cfg.data.train_batch_size,
            ps.dp_rank,
            ps.dp_size,
            cfg.data.seed,
            shuffle=cfg.data.shuffle,
        )
        steps_per_epoch = len(self.sampler)
        if steps_per_epoch == 0:
            raise ValueError(
                f"data.train_batch_size={cfg.data.train_batch_size} exceeds the "
                f"{len(self.train_data)} training prompts."
            )
        self.total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs

        # The rules, a custom function (imported now: a broken file fails before any model is built) or
        # a reward server; a reward model replaces it once the models exist.
        self.reward_fn = make_reward_fn(cfg, self.tokenizer)
        corr = cfg.algorithm.rollout_correction
        self.passes = ForwardPasses.from_config(cfg)
        self.rejection = parse_rs(corr.rollout_rs, corr.rollout_rs_threshold) if corr.rollout_rs else None
        # The engine's log-probs of the sampled tokens: for the mismatch metrics and corrections.
        # (always with staleness > 0: the behaviour policy is then older than the trainer's actor)
        self.keep_rollout_log_probs = bool(
            arr.rollout.calculate_log_probs or corr.rollout_is or self.rejection or arr.rollout.max_staleness
        )
        self.kl_ctrl = get_kl_controller(
            cfg.algorithm.kl_ctrl.type,
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.kl_ctrl.target_kl,
            cfg.algorithm.kl_ctrl.horizon,
        )
        # The output directory is this run's before anything heavy is built.
        self.ckpt = CheckpointManager(
            cfg.trainer.default_local_dir,
            ps,
            cfg.trainer.max_ckpt_to_keep,
            side_file_dirs=(cfg.data.tokenizer, arr.model.path),
            permissions=cfg.trainer.checkpoint_permissions,
            claim=True,  # rank 0 locks the directory for this run (one line if another run has it)
        )
        # Colocated, the engine starts first, on an empty GPU, so that rollout.gpu_memory_utilization is
        # the share of the whole GPU it takes; it gives that memory back until the first rollout.
        engine = None if self.placement.separate_rollout else start_engine(cfg, ps, self.model_args)
        separate_critic = self.placement.separate_critic
        self.models = build_models(
            cfg, ps, self.model_args, self.total_steps, with_critic=not separate_critic
        )
        self.critic: LocalCritic | RemoteCritic | None = None  # the critic role (critic_role)
        if separate_critic:
            self.critic = RemoteCritic(ps, self.total_steps, self.pad_id)
        elif self.models.critic is not None:
            self.critic = LocalCritic(cfg, ps, self.models.critic, self.models.critic_optim, self.passes)
        if self.models.reward is not None:
            self.reward_fn = make_reward_fn(cfg, self.tokenizer, ps, self.models.reward)
        self._batches = iter(self.sampler)
        if engine is not None:
            self.rollouts = ColocatedRollout(
                cfg, ps, self.models, engine, lambda: next(self._batches), tokenizer=self.tokenizer
            )
        else:
            self.rollouts = SeparateRollout(
                cfg,
                ps,
                self.models,
                len(self.placement.rollout),
                lambda: next(self._batches),
                lambda indices: [self.train_data[i].prompt_ids for i in indices],
                lambda step: self.sampling(step, validate=False),
                self.total_steps,
            )
        self.sync_probe = SyncProbe(cfg, ps, self.train_data, self.pad_id, self.stop_ids)
        self.timer = Timer(ps.device)
        self.logger = MetricsLogger(
            cfg.trainer.logger,
            cfg.trainer.log_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            to_dict(cfg),
            enabled=ps.rank == 0,
            block_freq=cfg.trainer.console_block_freq,
        )
        self.global_step = 0
        self._resumed_row: dict[str, float] | None = None  # the resumed step's metrics (Trainer.save)
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps, log if ps.rank == 0 else None)
        self.peak_flops = measure_peak_flops(ps.device)

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        """Resume (trainer.resume_mode), then train to the last step; a stop signal ends the loop after
        the current step with a checkpoint and :class:`~megatron_rl.run.lifecycle.Preempted`."""
        from megatron_rl.run.lifecycle import REPLACE, Preempted, PreemptionWatch

        self._maybe_resume()
        self.rollouts.start(self.global_step)  # separate rollout: weights out, the next steps asked for
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
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
        self._replay_row()
        if self.ps.rank == 0:
            write_config_record(self.cfg, fresh=self.global_step == 0)
        if self.val_data is not None and (cfg.val_only or (cfg.val_before_train and self.global_step == 0)):
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
                prompts = self.rollouts.prompts(self.global_step)
                last = self.step(prompts, more=lambda: next(self._batches))
                if self.val_data is not None and cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0:
                    last.update(self.validate())
                is_last = self.global_step == self.total_steps
                saved = None
                every = cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0
                if every or (is_last and cfg.save_at_end):
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

    # ------------------------------------------------------------------------------------------ run record

    def step(self, prompt_indices: list[int], more=None) -> dict[str, float]:
        """One PPO step on this rank's prompts; ``more()`` gives the next prompts when DAPO's group filter
        (algorithm.filter_groups) needs to refill the batch."""
        from megatron_rl import ppo

        cfg, ps, m, timer = self.cfg, self.ps, self.models, self.timer
        arr = cfg.actor_rollout_ref
        t_step = time.perf_counter()
        metrics: dict[str, float] = {}
        tokens = TokenStats()  # real and processed tokens of the training passes (perf/padding_fraction)

        batch = self.scored_rollout(prompt_indices, more, metrics)
        metrics.update(self.rollouts.step_metrics(self.global_step))
        if self.sync_probe.due(self.global_step):  # the engine's policy == the actor's (sync_check)
            with timer("sync_check"):
                metrics.update(self.sync_probe.run(self.global_step, self.rollouts, m.actor, self.passes))
        if self.critic is not None:  # a critic on ranks of its own computes values from here on
            self.critic.begin_values(self.global_step, batch)

        with timer("old_log_prob"):
            batch.old_log_probs = ppo.compute_log_probs(
                m.actor, ps, batch, self.passes.old_log_prob, arr.rollout.temperature, stats=tokens
            )
        if batch.rollout_log_probs is not None:
            with timer("rollout_corr"):
                metrics.update(correct_mismatch(batch, cfg.algorithm.rollout_correction, ps.dp_group))
        if m.ref is not None:
            with timer("ref"):
                batch.ref_log_probs = ppo.compute_log_probs(
                    m.ref, ps, batch, self.passes.ref, arr.rollout.temperature, stats=tokens
                )
        if self.critic is not None:
            with timer("values"):
                batch.values = self.critic.values(batch, stats=tokens)
        with timer("adv"):
            metrics.update(self.compute_advantages(batch))
            if self.rejection is not None:
                metrics.update(reject(batch, self.rejection, ps.dp_group))

        n, seed = arr.rollout.n, self.global_step  # seed: mini-batch shuffling (actor/critic .shuffle)
        if self.critic is not None:  # on ranks of its own, the critic updates while the actor does
            with timer("update_critic"):
                self.critic.begin_update(batch, seed, stats=tokens)
        if self.global_step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                temperature = arr.rollout.temperature
                metrics.update(
                    ppo.update_actor(
                        m.actor,
                        m.actor_optim,
                        ps,
                        batch,
                        arr.actor,
                        n,
                        temperature,
                        shuffle_seed=seed,
                        stats=tokens,
                    )
                )
            if arr.actor.use_kl_loss:
                metrics["actor/kl_coef"] = arr.actor.kl_loss_coef
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self.critic.update_metrics())
        # the engines get version global_step (separate rollout: then generate step + 1 + max_staleness)
        self.rollouts.policy_updated(self.global_step, timer)

        with timer("metrics"):
            self.nonfinite.check(metrics, self.global_step, self.ckpt.latest)
            metrics.update(
                data_metrics(batch, cfg.data.max_prompt_length, cfg.data.max_response_length, ps.dp_group)
            )
            metrics.update(staleness_metrics(batch, self.global_step, ps))
            # padded tokens / tokens processed by old_log_prob, ref, values and both updates
            metrics["perf/padding_fraction"] = tokens.padding_fraction(ps.dp_group, ps.device)
        metrics.update(self.timer.pop())
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["perf/time_per_step"] = metrics["timing_s/step"]
        metrics.update(
            perf_metrics(
                self.cfg,
                self.ps,
                self.models,
                self.model_args,
                batch,
                metrics,
                self.peak_flops,
                self.timer,
                self.placement.world_size,
            )
        )
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = (self.global_step - 1) // len(self.sampler)
        return metrics

    # ------------------------------------------------------------------------------------------ phases

    def sampling(self, step: int, validate: bool) -> SamplingParams:
        """Sampling of step ``step``'s rollout (or of validation), seeded by (data.seed, step); the engine
        adds its DP rank (colocated) or slice (separate rollout) to the seed."""
        cfg, rollout = self.cfg, self.cfg.actor_rollout_ref.rollout
        if validate:
            vk = rollout.val_kwargs
            n, temperature, top_p, top_k, greedy = vk.n, vk.temperature, vk.top_p, vk.top_k, not vk.do_sample
        else:
            n, temperature, top_p, top_k = rollout.n, rollout.temperature, rollout.top_p, rollout.top_k
            greedy = not rollout.do_sample
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            greedy=greedy or temperature == 0,
            max_new_tokens=cfg.data.max_response_length,
            stop_token_ids=self.stop_ids,
            seed=cfg.data.seed * 1_000_003 + step * 1009 + (7 if validate else 0),
            return_logprobs=self.keep_rollout_log_probs and not validate,
        )

    def rollout(self, prompt_indices: list[int], timer: Timer, validate: bool = False) -> RolloutBatch:
        """Generate responses for this rank's prompts and assemble the batch (n samples per prompt)."""
        cfg, ps = self.cfg, self.ps
        data = self.val_data if validate else self.train_data
        with timer("data"):
            items = [data[i] for i in prompt_indices]
        tag = f"val/{self.global_step}" if validate else f"train/{self.global_step}"
        params = self.sampling(self.global_step, validate)
        try:
            gens, version = self.rollouts.generate(tag, [it.prompt_ids for it in items], params, timer, items)
        except WeightSyncError as e:  # the weights synced for this step's rollout: name the step
            e.args = (f"step {self.global_step}: {e}",)
            raise
        with timer("batch"):
            batch = RolloutBatch.from_generations(
                items, gens, self.pad_id, cfg.data.max_response_length, f"{self.global_step}-"
            )
            for m in batch.meta:
                m.policy_version = version
            return batch.to(ps.device)

    def _rewards_not_by_rule(self) -> bool:
        """Rewards come from a custom function, a reward server or a reward model, not the rules."""
        cfg = self.cfg
        return bool(cfg.custom_reward_function.path or cfg.reward_model.http.url or cfg.reward_model.enable)

    def scored_rollout(self, prompt_indices: list[int], more, metrics: dict[str, float]) -> RolloutBatch:
        """Rollout and rewards; with algorithm.filter_groups, groups whose samples all score the same are
        dropped and more prompts generated until this rank has its share of the batch (every rank runs
        the same number of rounds: generation is collective)."""
        from megatron_rl.algos.dapo import informative_groups
        from megatron_rl.reward import scoring

        fg, ps = self.cfg.algorithm.filter_groups, self.ps
        quota = len(prompt_indices) * self.cfg.actor_rollout_ref.rollout.n
        kept: list[RolloutBatch] = []
        have = rounds = errors = 0
        groups = [0, 0]  # [dropped, seen] on this rank
        while True:
            rounds += 1
            batch = self.rollout(prompt_indices, self.timer)
            with self.timer("reward"):
                scores, n_err = scoring.reward_scores(self.reward_fn, batch, ps, self.cfg)
                scoring.place_scores(batch, scores)
            errors += n_err
            if not fg.enable:
                kept.append(batch)
                break
            uids = [mt.uid for mt in batch.meta]
            rows = [
                i
                for i, ok in enumerate(informative_groups(scoring.filter_values(batch, fg.metric), uids))
                if ok
            ]
            groups[0] += len(set(uids)) - len({uids[i] for i in rows})
            groups[1] += len(set(uids))
            rows = rows[: quota - have]
            if rows:
                kept.append(batch.select(rows))
                have += len(rows)
            short = torch.tensor([float(have < quota)], device=ps.device)
            dist.all_reduce(short, op=dist.ReduceOp.MAX)
            if short.item() == 0:
                break
            if 0 < fg.max_num_gen_batches <= rounds:
                raise ConfigError(
                    f"algorithm.filter_groups: {rounds} generation rounds (max_num_gen_batches) left "
                    f"{have} of {quota} sequences on rank {ps.rank} after dropping groups whose "
                    f"{fg.metric or 'acc'} is the same for every sample: raise "
                    "algorithm.filter_groups.max_num_gen_batches (0 = no limit) or use easier prompts."
                )
            prompt_indices = more()
        batch = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, self.pad_id)
        with self.timer("metrics"):
            metrics.update(scoring.reward_metrics(batch, errors, ps))
        if fg.enable:
            t = torch.tensor(groups, dtype=torch.float64, device=ps.device)
            dist.all_reduce(t, group=ps.dp_group)
            metrics["train/num_gen_batches"] = float(rounds)
            metrics["train/num_dropped_groups"] = t[0].item()
            metrics["train/dropped_group_ratio"] = (t[0] / t[1].clamp(min=1)).item()
        return batch

    def compute_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        from megatron_rl.algos import advantages as adv
        from megatron_rl.algos.kl import apply_kl_penalty

        alg, ps = self.cfg.algorithm, self.ps
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                batch.token_level_scores,
                batch.old_log_probs,
                batch.ref_log_probs,
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

    def validate(self) -> dict[str, float]:
        """Generation with val_kwargs on every validation prompt once, scored under verl's names:
        val-core/<data_source>/reward/mean@<n> (``acc`` instead of ``reward`` when the reward function
        returns it), its other keys and std@n under val-aux/ (megatron_rl.reward.scoring.ValidationScores).

        Rank r of the data-parallel group takes prompts r, r + dp, ...; every rank runs the same number
        of batches of the same size (the engine's generate is collective), a short last batch is filled
        with a repeated prompt whose scores are not counted.
        """
        from megatron_rl.reward.scoring import ValidationScores, reward_scores

        ps = self.ps
        n_val = len(self.val_data)
        mine = list(range(ps.dp_rank, n_val, ps.dp_size))
        per_rank = -(-n_val // ps.dp_size)
        bs = max(1, (self.cfg.data.val_batch_size or n_val) // ps.dp_size)
        scores = ValidationScores(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
        with self.timer("testing"):
            for start in range(0, per_rank, bs):
                idx = mine[start : start + bs]
                real = len(idx) * scores.n
                idx += [0] * (min(bs, per_rank - start) - len(idx))
                batch = self.rollout(idx, Timer(ps.device), validate=True)
                scores.add(batch, reward_scores(self.reward_fn, batch, ps, self.cfg)[0], real)
        out = scores.metrics(ps)
        out.update(self.timer.pop())
        return out

    def _checkpointed(self) -> tuple[dict[str, torch.nn.Module], dict[str, object]]:
        """(trained models by name, their optimizers by the same name)."""
        m = self.models
        models, optims = {"actor": m.actor}, {"actor": m.actor_optim}
        if m.critic is not None:
            models["critic"], optims["critic"] = m.critic, m.critic_optim
        return models, optims

    def save(self, row: dict[str, float] | None = None) -> str:
        """``row``: the step's metrics (without the save's own time), kept in the checkpoint so that a
        death between publishing it and writing the row loses no row (:meth:`_replay_row`)."""
        models, optims = self._checkpointed()
        shards = {f"{k}_optim": o.counters() for k, o in optims.items()}
        remote = self.critic if isinstance(self.critic, RemoteCritic) else None
        if remote is not None:  # its counters ride in the actor's shard files, its files come from it
            shards["critic_optim"] = remote.counters()
        state = {
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "train_data": self.train_data.fingerprint(),
            "metrics_row": row,
        }
        queue = self.rollouts.queue_state()  # separate rollout: generations asked for, not trained on
        path = self.ckpt.save(
            self.global_step,
            models,
            optims,
            shards,
            state,
            {"rollout_queue": queue} if queue else None,
            before_publish=remote.save if remote is not None else None,
        )
        if self.ps.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def _maybe_resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        # auto: the tracker's checkpoint; an unusable tracker stops the run in one line (never step 0)
        path = t.resume_from_path if t.resume_mode == "resume_path" else self.ckpt.resume_path()
        if path is None:
            return
        self._check_same_data(path)
        models, optims = self._checkpointed()
        shards, state = self.ckpt.load(path, models, optims)
        for k, o in optims.items():
            o.load_counters(shards[f"{k}_optim"])
        if isinstance(self.critic, RemoteCritic):
            if "critic_optim" not in shards:
                raise CheckpointError(
                    f"{path} holds no critic: resume with the same algorithm (critic.enable)."
                )
            self.critic.load(path, shards["critic_optim"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.global_step = state["global_step"]
        # The row is replayed only into the run directory that wrote the checkpoint (its metrics file
        # may lack it); a run resumed from another directory's checkpoint starts its record after it.
        own = os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.cfg.trainer.default_local_dir)
        self._resumed_row = state.get("metrics_row") if own else None
        self.rollouts.load_queue(state.get("shared", {}).get("rollout_queue"))
        self.ckpt.resumed_from = path  # pruning never deletes it
        if self.ps.rank == 0:
            log.info("resumed from %s at step %d", path, self.global_step)

    def _replay_row(self) -> None:
        """After a resume: the resumed step's metrics row, from its checkpoint, if metrics.jsonl lacks it
        (the run died after publishing the checkpoint, before writing the row)."""
        row, log_ = self._resumed_row, self.logger
        if row is None or not (log_.enabled and "jsonl" in log_.sinks and os.path.isfile(log_.jsonl_path)):
            return
        with open(log_.jsonl_path) as f:
            if any(json.loads(line).get("step") == self.global_step for line in f if line.strip()):
                return
        log_.log(self.global_step, row, echo=lambda _line: None)

    def _check_same_data(self, path: str) -> None:
        """Resuming continues the sampler's position in the same prompts: other prompts (even as many)
        would be skipped or repeated without a word, so they stop the run in one line."""
        state_file = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_file):
            return  # not a checkpoint: CheckpointManager.load says so
        with open(state_file) as f:
            saved = json.load(f).get("train_data")
        if saved is not None and saved != self.train_data.fingerprint():
            raise ConfigError(
                f"data.train_files={self.cfg.data.train_files} hold other prompts than the run that wrote "
                f"{path}; resuming would skip or repeat prompts. Restore the files, or start a new run from "
                f"those weights: actor_rollout_ref.model.path={os.path.join(path, 'actor')} with "
                "trainer.resume_mode=disable (or another trainer.default_local_dir)."
            )


def start_engine(cfg: Config, ps: ParallelState, model_args):
    """The colocated rollout engine (collective), its memory given back until the first rollout."""
    from megatron_rl.rollout import create_engine

    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "sglang" and ps.device.type != "cuda":
        raise RuntimeError(
            "actor_rollout_ref.rollout.name=sglang needs a GPU; on CPU set actor_rollout_ref.rollout.name=hf."
        )
    t0 = time.perf_counter()
    engine = create_engine(rollout, cfg.actor_rollout_ref.model.path, model_args, ps, seed=cfg.data.seed)
    if ps.rank == 0:
        graphs = "on" if rollout.enable_cuda_graph and rollout.name == "sglang" else "off"
        print(
            f"megatron-rl: rollout engine {rollout.name} (TP={rollout.tensor_model_parallel_size}, "
            f"CUDA graphs {graphs}) started in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    if rollout.free_cache_engine:
        engine.release_memory()
    return engine


def staleness_metrics(batch: RolloutBatch, step: int, ps: ParallelState) -> dict[str, float]:
    """rollout/staleness/{mean,max}: policy versions between the weights that sampled each sequence and
    the actor it trains (step - 1); 0 in the synchronous loop."""
    lag = torch.tensor([float(step - 1 - m.policy_version) for m in batch.meta], dtype=torch.float64)
    t = torch.stack([lag.sum(), torch.tensor(float(lag.numel()), dtype=torch.float64)]).to(ps.device)
    top = lag.max().reshape(1).to(ps.device)
    dist.all_reduce(t, group=ps.dp_group)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.dp_group)
    return {"rollout/staleness/mean": (t[0] / t[1].clamp(min=1)).item(), "rollout/staleness/max": top.item()}
