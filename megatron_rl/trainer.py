"""The PPO loop. One step, on every rank:

    prompts (this DP rank's shard)
      -> park training state in host memory (*.megatron.*_offload keys)    timing_s/offload
      -> sync actor weights into the rollout engine (reshard stream)      timing_s/reshard
      -> generate rollout.n responses per prompt, reload the parked state  timing_s/gen, offload
      -> rule rewards on the decoded responses                             timing_s/reward
      -> old log-probs (actor), ref log-probs, values (critic)             timing_s/old_log_prob, ref, values
      -> KL-shaped token rewards, advantages                               timing_s/adv
      -> critic update, actor update (after trainer.critic_warmup)         timing_s/update_critic, _actor
      -> metrics; validation every test_freq; checkpoint every save_freq   timing_s/save_checkpoint

The engine holds GPU memory only while it generates (colocated hybrid engine): it is resumed before
generation and released right after; with the offload keys on, the training state is in host memory
during that time, so the two never hold the GPU at once. Sampling is seeded by (seed, step), so a
resumed run repeats the same rollouts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import Config, ConfigError, to_dict
from megatron_rl.launch_checks import LaunchError
from megatron_rl.metrics import MetricsLogger, Timer, data_metrics, progress_bar, set_aside
from megatron_rl.offload import HostParking
from megatron_rl.parallel import ParallelState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Models:
    actor: torch.nn.Module
    actor_optim: object
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    critic_optim: object | None
    reward: torch.nn.Module | None = None  # reward_model.enable


class Trainer:
    def __init__(self, cfg: Config, ps: ParallelState) -> None:
        from transformers import AutoTokenizer

        from megatron_rl.algos.kl import get_kl_controller
        from megatron_rl.algos.rollout_corr import parse_rs
        from megatron_rl.checkpoint import CheckpointManager
        from megatron_rl.data import PromptDataset, ResumableDistributedSampler
        from megatron_rl.models.hf import check_sliding_window
        from megatron_rl.models.loading import load_model_args_any
        from megatron_rl.reward import RULE_DATA_SOURCES, RewardManager, load_custom_reward_function
        from megatron_rl.rollout.base import stop_token_ids

        self.cfg, self.ps = cfg, ps
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

        compute_score = None
        if cfg.custom_reward_function.path:
            compute_score = load_custom_reward_function(
                cfg.custom_reward_function.path, cfg.custom_reward_function.name
            )
        crf = cfg.custom_reward_function
        if cfg.reward_model.http.url:
            from megatron_rl.http_reward import HttpRewardManager

            self.reward_fn = HttpRewardManager(self.tokenizer, cfg.reward_model.http)
        else:
            self.reward_fn = RewardManager(self.tokenizer, compute_score, crf.reward_kwargs, crf.timeout_s)
        corr = cfg.algorithm.rollout_correction
        self.rejection = parse_rs(corr.rollout_rs, corr.rollout_rs_threshold) if corr.rollout_rs else None
        # The engine's log-probs of the sampled tokens: for the mismatch metrics and corrections.
        self.keep_rollout_log_probs = bool(
            arr.rollout.calculate_log_probs or corr.rollout_is or self.rejection
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
        # The engine starts first, on an empty GPU, so that rollout.gpu_memory_utilization is the share
        # of the whole GPU it takes; colocated, it gives that memory back until the first rollout.
        t0 = time.perf_counter()
        self.engine = self._build_engine()
        if ps.rank == 0:
            r = arr.rollout
            graphs = "on" if r.enable_cuda_graph and r.name == "sglang" else "off"
            print(
                f"megatron-rl: rollout engine {r.name} (TP={r.tensor_model_parallel_size}, CUDA graphs "
                f"{graphs}) started in {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        if cfg.actor_rollout_ref.rollout.free_cache_engine:
            self.engine.release_memory()
        self.models = self._build_models()
        if self.models.reward is not None:
            from megatron_rl.reward_model import ModelReward, reward_model_tokenizer

            rm = cfg.reward_model
            actor_tok = self.tokenizer
            if rm.model.input_tokenizer:
                actor_tok = AutoTokenizer.from_pretrained(rm.model.input_tokenizer, trust_remote_code=True)
            rm_tok = reward_model_tokenizer(rm.model.path, actor_tok, rm.model.trust_remote_code)
            self.reward_fn = ModelReward(
                self.models.reward, ps, rm.micro_batch_size_per_gpu, actor_tok, rm_tok, rm.max_length
            )
        self.parking = HostParking(ps.device)
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
        self.nonfinite_streak = 0  # PPO steps in a row with a skipped (non-finite) update
        self.weights_stale = True  # the engine starts without the actor's weights
        self.peak_flops = _measure_peak_flops(ps.device)

    # ------------------------------------------------------------------------------------------ setup

    def _build_models(self) -> Models:
        """Actor (+ optimizer), reference (only when a KL term needs it), critic (+ optimizer).

        Each role uses its own ``megatron`` section for dtype and attention; the parallel layout is
        shared (validated). LR schedules span the optimizer steps each model will actually take.
        """
        from megatron_rl.models.builder import DTYPES, TrainingOptions, build_model
        from megatron_rl.models.loading import load_weights
        from megatron_rl.optim import ModelOptimizer

        cfg, ps, arr = self.cfg, self.ps, self.cfg.actor_rollout_ref

        def model(role: str, path: str, mcfg, recompute: bool = False) -> torch.nn.Module:
            dtype = torch.float32 if ps.device.type == "cpu" else DTYPES[mcfg.params_dtype]
            options = TrainingOptions(
                sequence_parallel=mcfg.sequence_parallel,
                recompute_granularity=mcfg.recompute_granularity if recompute else None,
                recompute_method=mcfg.recompute_method,
                recompute_num_layers=mcfg.recompute_num_layers,
            )
            m = build_model(
                self.model_args, ps, role=role, dtype=dtype, sdpa=mcfg.use_sdpa_attention, options=options
            )
            load_weights(m, path, ps)
            return m

        def optim_steps(epochs: int, mini_batch: int, ppo_steps: int) -> int:
            return ppo_steps * epochs * (cfg.data.train_batch_size // mini_batch)

        actor = model("actor", arr.model.path, arr.actor.megatron, arr.model.enable_gradient_checkpointing)
        # The actor does not step during trainer.critic_warmup.
        actor_steps = optim_steps(
            arr.actor.ppo_epochs, arr.actor.ppo_mini_batch_size, self.total_steps - cfg.trainer.critic_warmup
        )
        actor_optim = ModelOptimizer(
            actor, arr.actor.optim, arr.actor.megatron, ps, actor_steps, key="actor_rollout_ref.actor.optim"
        )
        need_ref = cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
        ref = model("actor", arr.model.path, arr.ref.megatron).eval() if need_ref else None
        critic = critic_optim = None
        if cfg.critic.enable:
            critic = model(
                "critic",
                cfg.critic.model.path,
                cfg.critic.megatron,
                cfg.critic.model.enable_gradient_checkpointing,
            )
            critic_steps = optim_steps(
                cfg.critic.ppo_epochs, cfg.critic.ppo_mini_batch_size, self.total_steps
            )
            critic_optim = ModelOptimizer(
                critic, cfg.critic.optim, cfg.critic.megatron, ps, critic_steps, key="critic.optim"
            )
        reward = None
        if cfg.reward_model.enable:
            from megatron_rl.models.loading import load_model_args_any

            rm = cfg.reward_model
            options = TrainingOptions(sequence_parallel=rm.megatron.sequence_parallel)
            dtype = torch.float32 if ps.device.type == "cpu" else DTYPES[rm.megatron.params_dtype]
            args = load_model_args_any(rm.model.path)
            reward = build_model(
                args, ps, role="reward", dtype=dtype, sdpa=rm.megatron.use_sdpa_attention, options=options
            )
            load_weights(reward, rm.model.path, ps)
            reward.eval()
        return Models(actor, actor_optim, ref, critic, critic_optim, reward)

    def _build_engine(self):
        from megatron_rl.rollout import create_engine

        rollout = self.cfg.actor_rollout_ref.rollout
        if rollout.name == "sglang" and self.ps.device.type != "cuda":
            raise RuntimeError(
                "actor_rollout_ref.rollout.name=sglang needs a GPU; "
                "on CPU set actor_rollout_ref.rollout.name=hf."
            )
        return create_engine(
            rollout, self.cfg.actor_rollout_ref.model.path, self.model_args, self.ps, seed=self.cfg.data.seed
        )

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        """Resume (trainer.resume_mode), then train to the last step; a stop signal ends the loop after
        the current step with a checkpoint and :class:`~megatron_rl.lifecycle.Preempted`."""
        from megatron_rl.lifecycle import Preempted, PreemptionWatch

        self._maybe_resume()
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
        self._write_config_record()
        if self.val_data is not None and cfg.val_before_train and self.global_step == 0:
            self.logger.log(0, self.validate())
        bar = progress_bar(
            self.total_steps, self.global_step, enabled=self.ps.rank == 0 and "console" in cfg.logger
        )
        batches = iter(self.sampler)
        # SIGTERM / SIGINT / SIGUSR2 only set a flag; after each step (and its save) every rank agrees
        # on it, so all save the same step and leave together (megatron_rl.lifecycle).
        with PreemptionWatch() as watch:
            while self.global_step < self.total_steps:
                self.global_step += 1
                last = self.step(next(batches), more=lambda: next(batches))
                if self.val_data is not None and cfg.test_freq > 0 and self.global_step % cfg.test_freq == 0:
                    last.update(self.validate())
                is_last = self.global_step == self.total_steps
                saved = None
                every = cfg.save_freq > 0 and self.global_step % cfg.save_freq == 0
                if every or (is_last and cfg.save_at_end):
                    with self.timer("save_checkpoint"):
                        saved = self.save()
                    last.update(self.timer.pop())
                self.logger.log(self.global_step, last, echo=bar.write, last=is_last)
                bar.update(1)
                if not is_last and watch.requested(device=self.ps.device):
                    saved = saved or self.save()
                    bar.close()
                    self.logger.close()
                    if self.ps.rank == 0:
                        again = "" if cfg.resume_mode == "auto" else " and trainer.resume_mode=auto"
                        print(
                            f"megatron-rl: received {watch.signal_name} at step {self.global_step}; saved "
                            f"{saved}; exiting (resume with the same command{again})",
                            flush=True,
                        )
                    raise Preempted(watch.exit_code)
        bar.close()
        self.logger.close()
        self._write_summary(last)
        return last

    # ------------------------------------------------------------------------------------------ run record

    def _write_config_record(self) -> None:
        """The resolved config of this run, beside its checkpoints (rank 0). A fresh run in a directory
        that holds an earlier run's record sets that aside (config.1.yaml, summary.1.json, ...)."""
        if self.ps.rank != 0:
            return
        from omegaconf import OmegaConf

        out = self.cfg.trainer.default_local_dir
        os.makedirs(out, exist_ok=True)
        if self.global_step == 0:
            for name in ("config.yaml", "summary.json"):
                set_aside(os.path.join(out, name))
        OmegaConf.save(OmegaConf.create(to_dict(self.cfg)), os.path.join(out, "config.yaml"))

    def _write_summary(self, last: dict[str, float]) -> None:
        """Final scores and where everything is: printed, and summary.json beside the checkpoints."""
        if self.ps.rank != 0:
            return
        t = self.cfg.trainer
        scores = {k: v for k, v in last.items() if k.startswith(("val", "critic/score/mean"))}
        latest = self.ckpt.latest()
        summary = {
            "global_step": self.global_step,
            "final": scores,
            "checkpoint": latest,
            "config": os.path.join(t.default_local_dir, "config.yaml"),
            "metrics": self.logger.jsonl_path if "jsonl" in t.logger else None,
            "plot": f"python -m megatron_rl.plot {t.log_dir}" if "jsonl" in t.logger else None,
        }
        with open(os.path.join(t.default_local_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        lines = [f"megatron-rl: finished at step {self.global_step}"]
        lines += [f"  {k} = {v:.4g}" for k, v in sorted(scores.items())]
        lines.append(f"  checkpoint: {latest or 'none saved'}")
        lines.append(f"  config:     {summary['config']}")
        if summary["metrics"]:
            lines.append(f"  metrics:    {summary['metrics']}   plot: {summary['plot']}")
        print("\n".join(lines), flush=True)

    def step(self, prompt_indices: list[int], more=None) -> dict[str, float]:
        """One PPO step on this rank's prompts; ``more()`` gives the next prompts when DAPO's group filter
        (algorithm.filter_groups) needs to refill the batch."""
        from megatron_rl import ppo

        cfg, ps, m, timer = self.cfg, self.ps, self.models, self.timer
        arr = cfg.actor_rollout_ref
        t_step = time.perf_counter()
        metrics: dict[str, float] = {}

        batch = self.scored_rollout(prompt_indices, more, metrics)

        with timer("old_log_prob"):
            batch.old_log_probs = ppo.compute_log_probs(
                m.actor,
                ps,
                batch,
                arr.rollout.log_prob_micro_batch_size_per_gpu,
                temperature=arr.rollout.temperature,
            )
        if batch.rollout_log_probs is not None:
            with timer("rollout_corr"):
                metrics.update(self.correct_mismatch(batch))
        if m.ref is not None:
            with timer("ref"):
                batch.ref_log_probs = ppo.compute_log_probs(
                    m.ref,
                    ps,
                    batch,
                    arr.ref.log_prob_micro_batch_size_per_gpu,
                    temperature=arr.rollout.temperature,
                )
        if m.critic is not None:
            with timer("values"):
                batch.values = ppo.compute_values(
                    m.critic, ps, batch, cfg.critic.ppo_micro_batch_size_per_gpu
                )
        with timer("adv"):
            metrics.update(self.compute_advantages(batch))
            if self.rejection is not None:
                metrics.update(self.reject(batch))

        n, seed = arr.rollout.n, self.global_step  # seed: mini-batch shuffling (actor/critic .shuffle)
        if m.critic is not None:
            with timer("update_critic"):
                metrics.update(
                    ppo.update_critic(m.critic, m.critic_optim, ps, batch, cfg.critic, n, shuffle_seed=seed)
                )
        if self.global_step > cfg.trainer.critic_warmup:
            with timer("update_actor"):
                temperature = arr.rollout.temperature
                metrics.update(
                    ppo.update_actor(
                        m.actor, m.actor_optim, ps, batch, arr.actor, n, temperature, shuffle_seed=seed
                    )
                )
            self.weights_stale = True
            if arr.actor.use_kl_loss:
                metrics["actor/kl_coef"] = arr.actor.kl_loss_coef

        with timer("metrics"):
            self._guard_nonfinite(metrics)
            metrics.update(
                data_metrics(batch, cfg.data.max_prompt_length, cfg.data.max_response_length, ps.dp_group)
            )
        metrics.update(self.timer.pop())
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["perf/time_per_step"] = metrics["timing_s/step"]
        metrics.update(self._perf_metrics(batch, metrics))
        metrics["training/global_step"] = self.global_step
        metrics["training/epoch"] = (self.global_step - 1) // len(self.sampler)
        return metrics

    # ------------------------------------------------------------------------------------------ phases

    def rollout(self, prompt_indices: list[int], timer: Timer, validate: bool = False) -> RolloutBatch:
        """Generate responses for this rank's prompts and assemble the batch (n samples per prompt)."""
        from megatron_rl.rollout import SamplingParams
        from megatron_rl.rollout.reshard import sync_weights

        cfg, ps = self.cfg, self.ps
        rollout = cfg.actor_rollout_ref.rollout
        data = self.val_data if validate else self.train_data
        with timer("data"):
            items = [data[i] for i in prompt_indices]
        free = rollout.free_cache_engine

        with timer("offload"):
            self._park_training_state()
        if free:
            with timer("engine"):  # the engine's memory comes back (and training's cache goes)
                if ps.device.type == "cuda":
                    torch.cuda.empty_cache()  # training's cached blocks go back to the device
                self.engine.resume_memory()
        if self.weights_stale:
            with timer("reshard"):
                sync_weights(
                    self.models.actor,
                    ps,
                    self.engine,
                    rollout.update_weights_bucket_megabytes,
                    _dtype(rollout.dtype, ps),
                )
            self.weights_stale = False
        if cfg.actor_rollout_ref.actor.megatron.param_offload:
            with timer("offload"):
                self.parking.park(self.models.actor.parameters())
        if validate:
            vk = rollout.val_kwargs
            n, temperature, top_p, top_k, greedy = vk.n, vk.temperature, vk.top_p, vk.top_k, not vk.do_sample
        else:
            n, temperature, top_p, top_k = rollout.n, rollout.temperature, rollout.top_p, rollout.top_k
            greedy = not rollout.do_sample
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            greedy=greedy or temperature == 0,
            max_new_tokens=cfg.data.max_response_length,
            stop_token_ids=self.stop_ids,
            seed=cfg.data.seed * 1_000_003 + self.global_step * 1009 + ps.dp_rank + (7 if validate else 0),
            return_logprobs=self.keep_rollout_log_probs and not validate,
        )
        with timer("gen"):
            gens = self.engine.generate([it.prompt_ids for it in items], params)
        if free:
            with timer("engine"):
                # SGLang drops its weights with its memory: the next rollout streams them again.
                self.engine.release_memory()
            self.weights_stale = True
        with timer("offload"):
            self.parking.reload()
        with timer("batch"):
            return self._assemble(items, gens, params)

    def _assemble(self, items, gens, params) -> RolloutBatch:
        """Generations -> the [B*n] rollout batch on the device."""
        from megatron_rl.data import collate_left_pad

        cfg, ps = self.cfg, self.ps

        # [B*n] rows: prompt i's samples are adjacent and share a uid (the GRPO/RLOO group).
        prompts, metas, responses = [], [], []
        for it, samples in zip(items, gens, strict=True):
            uid = f"{self.global_step}-{it.index}"
            for g in samples:
                prompts.append(it)
                responses.append(g.token_ids[: cfg.data.max_response_length])
                metas.append(
                    SeqMeta(
                        uid=uid,
                        data_source=it.data_source,
                        ground_truth=it.ground_truth,
                        extra_info=it.extra_info,
                        messages=it.messages,
                    )
                )
        prompt_ids, prompt_mask = collate_left_pad(prompts, self.pad_id)
        width = max(1, max(len(r) for r in responses))
        resp = torch.full((len(responses), width), self.pad_id, dtype=torch.long)
        resp_mask = torch.zeros(len(responses), width)
        for i, r in enumerate(responses):
            resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            resp_mask[i, : len(r)] = 1.0
        batch = RolloutBatch.from_tokens(prompt_ids, prompt_mask, resp, resp_mask, metas)
        if params.return_logprobs:
            # NaN where the engine gave no log-prob (the trainer's own value is used there)
            lp = torch.full((len(responses), width), math.nan)
            engine_lps = [g.logprobs or [] for samples in gens for g in samples]
            for i, (r, got) in enumerate(zip(responses, engine_lps, strict=True)):
                got = got[: len(r)]
                lp[i, : len(got)] = torch.tensor(got, dtype=torch.float32)
            batch.rollout_log_probs = lp
        return batch.to(ps.device)

    def _park_training_state(self) -> None:
        """Before generation: park what the *.megatron.*_offload keys name (see megatron_rl.offload)."""
        m, arr, park = self.models, self.cfg.actor_rollout_ref, self.parking.park
        trained = [("actor", m.actor, m.actor_optim, arr.actor.megatron)]
        if m.critic is not None:
            trained.append(("critic", m.critic, m.critic_optim, self.cfg.critic.megatron))
        for name, model, optim, mcfg in trained:
            if mcfg.optimizer_offload:
                park(optim.state_tensors())
            if mcfg.grad_offload:
                park(optim.grad_tensors(), keep_values=False)
            if mcfg.param_offload and name != "actor":  # the actor's after the weight sync
                park(model.parameters())
        if m.ref is not None and arr.ref.megatron.param_offload:
            park(m.ref.parameters())
        if m.reward is not None and self.cfg.reward_model.megatron.param_offload:
            park(m.reward.parameters())

    def _rewards_not_by_rule(self) -> bool:
        """Rewards come from a custom function, a reward server or a reward model, not the rules."""
        cfg = self.cfg
        return bool(cfg.custom_reward_function.path or cfg.reward_model.http.url or cfg.reward_model.enable)

    def _guard_nonfinite(self, metrics: dict[str, float]) -> None:
        """Skipped updates (non-finite loss or gradient norm) are logged; trainer.max_nonfinite_steps PPO
        steps in a row with one stop the run before anything is saved (the last checkpoint stays good)."""
        skipped = {
            phase: int(metrics.get(f"{role}/nonfinite_grad_steps", 0))
            for phase, role in (("update_actor", "actor"), ("update_critic", "critic"))
        }
        if not any(skipped.values()):
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        where = ", ".join(f"{phase}: {n}" for phase, n in skipped.items() if n)
        if self.ps.rank == 0:
            log.warning(
                "step %d: optimizer steps skipped for a non-finite loss or gradient norm (%s); %d step(s) "
                "in a row",
                self.global_step,
                where,
                self.nonfinite_streak,
            )
        limit = self.cfg.trainer.max_nonfinite_steps
        if limit > 0 and self.nonfinite_streak >= limit:
            latest = self.ckpt.latest()
            raise NonFiniteError(
                f"{self.nonfinite_streak} steps in a row (the last: step {self.global_step}, {where}) had a "
                "non-finite loss or gradient norm, so the run stopped "
                f"(trainer.max_nonfinite_steps={limit}); "
                f"the last checkpoint is {latest or 'none (nothing was saved)'}. Lower "
                "actor_rollout_ref.actor.optim.lr / critic.optim.lr or set *.optim.clip_grad, then resume."
            )

    def scored_rollout(self, prompt_indices: list[int], more, metrics: dict[str, float]) -> RolloutBatch:
        """Rollout and rewards; with algorithm.filter_groups, groups whose samples all score the same are
        dropped and more prompts generated until this rank has its share of the batch (every rank runs
        the same number of rounds: generation is collective)."""
        from megatron_rl import scoring
        from megatron_rl.algos.dapo import informative_groups

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

    def correct_mismatch(self, batch: RolloutBatch) -> dict[str, float]:
        """Mismatch metrics of the engine's log-probs against the trainer's (old_log_probs), and the
        truncated importance weights (algorithm.rollout_correction.rollout_is) -> batch.rollout_is_weights."""
        from megatron_rl.algos import rollout_corr

        corr, group = self.cfg.algorithm.rollout_correction, self.ps.dp_group
        # Where the engine gave no log-prob, its value is taken to be the trainer's (ratio 1).
        rollout_lp = torch.where(
            batch.rollout_log_probs.isnan(), batch.old_log_probs, batch.rollout_log_probs
        )
        batch.rollout_log_probs = rollout_lp
        mask = batch.response_mask
        metrics = rollout_corr.mismatch_metrics(batch.old_log_probs, rollout_lp, mask, group)
        if corr.rollout_is is not None:
            batch.rollout_is_weights, is_metrics = rollout_corr.importance_weights(
                batch.old_log_probs,
                rollout_lp,
                mask,
                corr.rollout_is,
                corr.rollout_is_threshold,
                corr.rollout_is_batch_normalize,
                group,
            )
            metrics.update(is_metrics)
        return metrics

    def reject(self, batch: RolloutBatch) -> dict[str, float]:
        """algorithm.rollout_correction.rollout_rs: rejected tokens (or sequences) leave the response mask
        and their advantages are zeroed; group statistics were taken before, over every sample."""
        from megatron_rl.algos.rollout_corr import rejection_mask

        keep, metrics = rejection_mask(
            batch.old_log_probs,
            batch.rollout_log_probs,
            batch.response_mask,
            self.rejection,
            self.ps.dp_group,
        )
        batch.response_mask = keep
        batch.advantages = batch.advantages * keep
        return metrics

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
        return metrics

    def validate(self) -> dict[str, float]:
        """Generation with val_kwargs on every validation prompt once, scored under verl's names:
        val-core/<data_source>/reward/mean@<n> (``acc`` instead of ``reward`` when the reward function
        returns it), its other keys and std@n under val-aux/ (megatron_rl.scoring.ValidationScores).

        Rank r of the data-parallel group takes prompts r, r + dp, ...; every rank runs the same number
        of batches of the same size (the engine's generate is collective), a short last batch is filled
        with a repeated prompt whose scores are not counted.
        """
        from megatron_rl.scoring import ValidationScores, reward_scores

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

    def _perf_metrics(self, batch: RolloutBatch, metrics: dict[str, float]) -> dict[str, float]:
        ps = self.ps
        seq_lens = batch.attention_mask.sum(-1).double()
        sums = torch.stack([seq_lens.sum(), batch.response_mask.sum().double(), seq_lens.square().sum()])
        dist.all_reduce(sums, group=ps.dp_group)
        total, responses, squares = sums.tolist()
        out = {
            "perf/total_num_tokens": total,
            "perf/throughput": total / max(metrics["timing_s/step"], 1e-9) / ps.world_size,
        }
        # verl's per-token times: generation per response token, the other phases per token processed
        for phase in ("gen", "ref", "values", "adv", "update_critic", "update_actor"):
            if f"timing_s/{phase}" in metrics:
                per = responses if phase == "gen" else total
                out[f"timing_per_token_ms/{phase}"] = metrics[f"timing_s/{phase}"] * 1000 / max(per, 1.0)
        trained = [("actor", self.model_args, self.cfg.actor_rollout_ref.actor.ppo_epochs, True)]
        if self.models.critic is not None:
            trained.append(("critic", self.models.critic.args, self.cfg.critic.ppo_epochs, False))
        for role, args, epochs, lm_head in trained:
            upd = metrics.get(f"timing_s/update_{role}")
            if upd and self.peak_flops:
                flops = _train_flops(args, total, responses, squares, lm_head)
                flops *= epochs / ps.world_size  # per GPU
                out[f"perf/mfu/{role}"] = flops / upd / self.peak_flops
        # fp32 main weights and Adam's moments held on this rank (sharded over DP by the distributed
        # optimizer), wherever they are parked
        opts = [o for o in (self.models.actor_optim, self.models.critic_optim) if o is not None]
        out["perf/optimizer_state_gb"] = sum(o.state_bytes() for o in opts) / 2**30
        if ps.device.type == "cuda":
            out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(ps.device) / 2**30
            out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(ps.device) / 2**30
            # The engine allocates outside torch's caching allocator: device-level use is the true peak.
            out["perf/max_device_memory_used_gb"] = self.timer.max_device_used / 2**30
            out["perf/peak_tflops"] = self.peak_flops / 1e12
        else:
            import resource

            out["perf/max_memory_allocated_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return out

    # ------------------------------------------------------------------------------------------ checkpoints

    def _checkpointed(self) -> tuple[dict[str, torch.nn.Module], dict[str, object]]:
        """(trained models by name, their optimizers by the same name)."""
        m = self.models
        models, optims = {"actor": m.actor}, {"actor": m.actor_optim}
        if m.critic is not None:
            models["critic"], optims["critic"] = m.critic, m.critic_optim
        return models, optims

    def save(self) -> str:
        models, optims = self._checkpointed()
        shards = {f"{k}_optim": o.counters() for k, o in optims.items()}
        state = {
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "train_data": self.train_data.fingerprint(),
        }
        path = self.ckpt.save(self.global_step, models, optims, shards, state)
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
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.global_step = state["global_step"]
        self.weights_stale = True
        self.ckpt.resumed_from = path  # pruning never deletes it
        if self.ps.rank == 0:
            log.info("resumed from %s at step %d", path, self.global_step)

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


class NonFiniteError(LaunchError):
    """The run stopped after trainer.max_nonfinite_steps steps with non-finite updates (one line)."""

    same_on_all_ranks = True  # the gradient norms are reduced: every rank counts the same


def _dtype(name: str, ps: ParallelState) -> torch.dtype:
    from megatron_rl.models.builder import DTYPES

    return torch.float32 if ps.device.type == "cpu" else DTYPES[name]


def _train_flops(
    args, tokens: float, response_tokens: float, sum_sq_lens: float, lm_head: bool = True
) -> float:
    """Model FLOPs of one forward + backward over a batch: 6 per weight per token for the transformer
    body, the LM head on response tokens only (the only positions it runs on; the critic's scalar head
    is negligible), and causal attention scores (QK^T and AV over n^2 / 2 pairs per sequence of n
    tokens, times 3 for the backward)."""
    head = args.vocab_size * args.hidden_size  # the embedding lookup itself costs no FLOPs
    body = args.num_params() - head * (1 if args.tie_embeddings else 2)
    attention = 6 * args.num_layers * args.num_heads * args.head_dim * sum_sq_lens
    return 6 * body * tokens + (6 * head * response_tokens if lm_head else 0) + attention


def _measure_peak_flops(device: torch.device) -> float | None:
    """bf16 matmul throughput of this GPU (the MFU denominator); None on CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    iters = 20
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)
