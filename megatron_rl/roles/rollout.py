"""The rollout role: which prompts a step uses, its sampling parameters, the generations and the
policy version (the step whose updated weights sampled them), assembled into a RolloutBatch -- whether
the engine shares the training ranks or has ranks of its own (trainer.placement.rollout).

    rollout = make_rollout(...)           ColocatedRollout (engine from start_engine) | SeparateRollout
    rollout.start(step)                   after resume: nothing | stream weights, ask ahead
    prompts = rollout.prompts(step)       the sampler's next batch | the batch asked for earlier
    rollout.sampling(step, validate)      SamplingParams of a step's rollout (or of validation)
    batch = rollout.batch(step, idx, t)   park, sync, generate, reload | wait for the engines; then
                                          the RolloutBatch, each row's meta.policy_version set here
    rollout.policy_updated(step)          mark the engine stale | stream weights, ask for step+1+s
    rollout.staleness_metrics(batch)      rollout/staleness/{mean,max} against the trained version
    rollout.register_state(registry)      the queue: generations asked for but not yet trained on

Policy versions have one home: the role. Colocated, it is the version of the actor the engine syncs
from; separate, it is recorded with each step when the step is asked for (the engines serve requests
in the order posted, so a request sees exactly the weights streamed before it), kept in the queue
(and in a checkpoint), and written into the batch's meta when the step is trained on.

Colocated (the hybrid engine): every training rank holds an engine that takes the GPU only while it
generates (``*.megatron.*_offload`` park the training state meanwhile); weights are synced right before
generating, so step k always samples with the weights after step k-1 (staleness 0).

Separate: the engines run on their own ranks (``roles.remote_rollout``) and work through the requests
in the order posted. After step k the actor's weights (version k) are streamed, then step k+1+s is
asked for (s = rollout.max_staleness): with s=1 the engines generate step k+1 while step k trains, and
every sample of step k was drawn from version k-1-s (fewer at the start: version 0 is the first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config
from megatron_rl.config.batch_sizes import samples_per_draw
from megatron_rl.data import regroup_samples
from megatron_rl.offload import HostParking
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.transport import from_plain, to_plain
from megatron_rl.rollout import Generation, SamplingParams, engine_dtype
from megatron_rl.rollout.base import EngineFailure
from megatron_rl.rollout.reshard import WeightSyncError
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import SHARED, StateRegistry

if TYPE_CHECKING:
    from megatron_rl.data import PromptDataset


@dataclass
class RolloutData:
    """What the role turns prompt indices into batches with."""

    train: PromptDataset
    """The training prompts."""
    val: PromptDataset | None
    """The validation prompts (data.val_files), if any."""
    pad_id: int
    stop_ids: list[int]
    keep_log_probs: bool
    """Ask the engine for its log-probs of the sampled tokens (mismatch metrics and corrections)."""


def start_engine(cfg: Config, ps: ParallelState, model_args):
    """The colocated rollout engine (collective), its memory given back until the first rollout."""
    from megatron_rl.rollout import create_engine
    from megatron_rl.run.memory_plan import cuda_graph_max_bs

    rollout = cfg.actor_rollout_ref.rollout  # SGLang without a GPU: the pre-flight (and the engine) say so
    t0 = time.perf_counter()
    # SGLang captures decode graphs up to the rows one engine decodes at once (its prompts x n)
    graph_bs = cuda_graph_max_bs(cfg, ps.world_size // rollout.tensor_model_parallel_size)
    path = cfg.actor_rollout_ref.model.path
    r3 = cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
    engine = create_engine(
        rollout, path, model_args, ps, seed=rollout.seed, cuda_graph_max_bs=graph_bs, routed_experts=r3
    )
    if ps.rank == 0:
        sglang_graphs = rollout.enable_cuda_graph and rollout.name == "sglang"
        graphs = f"on, up to batch {graph_bs}" if sglang_graphs else "off"
        print(
            f"megatron-rl: rollout engine {rollout.name} (TP={rollout.tensor_model_parallel_size}, "
            f"CUDA graphs {graphs}) started in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    if rollout.free_cache_engine:
        engine.release_memory()
    return engine


def sampling_params(
    cfg: Config, stop_ids: list[int], step: int, validate: bool, logprobs: bool, dp_size: int = 1
) -> SamplingParams:
    """Sampling of step ``step``'s rollout (or of validation), seeded by (rollout.seed, step, validate); the
    engines derive each row's seed from these, its DP rank (colocated) or slice (separate) and its row
    (rollout.base.sample_seed); a training prompt gets config.batch_sizes.samples_per_draw of them."""
    rollout = cfg.actor_rollout_ref.rollout
    if validate:
        vk = rollout.val_kwargs
        n, temperature, top_p, top_k, greedy = vk.n, vk.temperature, vk.top_p, vk.top_k, not vk.do_sample
    else:
        n, temperature, top_p, top_k = rollout.n, rollout.temperature, rollout.top_p, rollout.top_k
        n, greedy = samples_per_draw(cfg, dp_size), not rollout.do_sample
    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        greedy=greedy or temperature == 0,
        max_new_tokens=cfg.data.max_response_length,
        stop_token_ids=stop_ids,
        seed=rollout.seed,
        step=step,
        validate=validate,
        return_logprobs=logprobs and not validate,
        return_routed_experts=cfg.actor_rollout_ref.actor.router_replay.mode == "R3" and not validate,
    )


def make_agent(cfg: Config, ps: ParallelState, tokenizer):
    """The multi-turn episode runner and its step statistics, or (None, None) without multi_turn.enable:
    the built-in agent loop, or with multi_turn.agent_function.path the user's harness against the
    OpenAI-compatible endpoint (rollout/openai_server.py); both take AgentLoop.run's arguments."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None, None
    from megatron_rl.rollout.agent_loop import AgentLoop, EpisodeStats

    if tokenizer is None:
        raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs ColocatedRollout(tokenizer=...)")
    if mt.agent_function.path:
        from megatron_rl.rollout.agent_function import AgentFunctionLoop

        return AgentFunctionLoop(mt, tokenizer, cfg.data.max_prompt_length), EpisodeStats()
    return AgentLoop(mt, ps, tokenizer), EpisodeStats()


class _Queue:
    """Steps whose prompts were drawn before the step ran: ``asked`` (step -> this rank's prompt
    indices and the policy version they are generated with) and, once taken, ``ready`` (step ->
    generations). A checkpoint keeps both, so a resume -- in either placement -- trains on exactly the
    prompts and samples the sampler moved past. Also the role's shared face: sampling parameters,
    batch assembly, staleness."""

    cfg: Config
    ps: ParallelState
    data: RolloutData
    trained: int
    """The actor's version: the last step whose update is done."""

    def __init__(self) -> None:
        self.asked: dict[int, tuple[list[int], int]] = {}
        self.ready: dict[int, list[list[Generation]]] = {}

    def generate(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None = None
    ) -> tuple[list[list[Generation]], int]:
        raise NotImplementedError

    def sampling(self, step: int, validate: bool) -> SamplingParams:
        keep = self.data.keep_log_probs
        return sampling_params(self.cfg, self.data.stop_ids, step, validate, keep, self.ps.dp_size)

    def batch(
        self, step: int, prompt_indices: list[int], timer: Timer, validate: bool = False
    ) -> RolloutBatch:
        """Generate responses for this rank's prompts and assemble the batch (n samples per prompt),
        every row's meta.policy_version the version that sampled it."""
        cfg, ps = self.cfg, self.ps
        data = self.data.val if validate else self.data.train
        if data is None:
            raise ValueError("validation needs data.val_files")
        with timer("data"):
            items = [data[i] for i in prompt_indices]
        tag = f"val/{step}" if validate else f"train/{step}"
        params = self.sampling(step, validate)
        try:
            gens, version = self.generate(tag, [it.prompt_ids for it in items], params, timer, items)
        except WeightSyncError as e:  # the weights synced for this step's rollout: name the step
            e.args = (f"step {step}: {e}",)
            raise
        with timer("batch"):
            batch = RolloutBatch.from_generations(
                items, gens, self.data.pad_id, cfg.data.max_response_length, f"{step}-"
            )
            for m in batch.meta:
                m.policy_version = version
            return batch.to(ps.device)

    def staleness_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """rollout/staleness/{mean,max}: policy versions between the weights that sampled each sequence and
        the actor it trains (the role's trained version); 0 in the synchronous loop."""
        ps = self.ps
        lag = torch.tensor([float(self.trained - m.policy_version) for m in batch.meta], dtype=torch.float64)
        t = torch.stack([lag.sum(), torch.tensor(float(lag.numel()), dtype=torch.float64)]).to(ps.device)
        top = lag.max().reshape(1).to(ps.device)
        dist.all_reduce(t, group=ps.dp_group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.dp_group)
        return {
            "rollout/staleness/mean": (t[0] / t[1].clamp(min=1)).item(),
            "rollout/staleness/max": top.item(),
        }

    def register_state(self, registry: StateRegistry) -> None:
        registry.register("rollout_queue", self, SHARED)

    def state_dict(self) -> dict | None:
        return self.queue_state()

    def load_state_dict(self, state: dict | None) -> None:
        self.load_queue(state)

    def _take_all(self) -> None:
        """Make every asked step ready (nothing to wait for when colocated)."""

    def queue_state(self) -> dict | None:
        """Collective: every step asked for and not trained on, in DP order (the same on every rank):
        {step: {"prompts": [...], "gens": [...], "version": v}} with the prompts of every DP rank."""
        self._take_all()
        if not self.asked:
            return None
        mine = {k: (self.asked[k][0], to_plain(self.ready[k]), self.asked[k][1]) for k in sorted(self.asked)}
        parts: list = [None] * self.ps.dp_size
        dist.all_gather_object(parts, mine, group=self.ps.dp_group)
        gather = {"prompts": 0, "gens": 1}  # every DP rank's, in DP order
        return {
            k: {**{f: [x for p in parts for x in p[k][j]] for f, j in gather.items()}, "version": mine[k][2]}
            for k in mine
        }

    def load_queue(self, state: dict | None) -> None:
        """This DP rank's share of a saved queue (DP size and samples per prompt may have changed)."""
        ps, per_draw = self.ps, samples_per_draw(self.cfg, self.ps.dp_size)
        for k, q in (state or {}).items():
            prompts, gens = regroup_samples(q["prompts"], q["gens"], per_draw)
            per = len(prompts) // ps.dp_size
            lo, hi = ps.dp_rank * per, (ps.dp_rank + 1) * per
            self.asked[int(k)] = (prompts[lo:hi], int(q["version"]))
            self.ready[int(k)] = from_plain(gens[lo:hi])

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of the role for step ``step`` (the separate rollout's engine time)."""
        return {}

    def _queued(self, tag: str) -> tuple[list[list[Generation]], int] | None:
        """A training step's generations and their version if ready (the step leaves the queue anyway)."""
        if not tag.startswith("train/"):
            return None
        step = int(tag.split("/")[1])
        asked = self.asked.pop(step, None)
        gens = self.ready.pop(step, None)
        return None if gens is None or asked is None else (gens, asked[1])


class ColocatedRollout(_Queue):
    """The engine inside the training processes (the hybrid engine)."""

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        data: RolloutData,
        actor: torch.nn.Module,
        park: Callable[[HostParking], None],
        engine,
        draw: Callable[[], list[int]],
        tokenizer=None,
        plan=None,
        new_engine: Callable[[], object] | None = None,
    ):
        """``park(parking)``: park the training state ``plan`` names before generating
        (roles.models.park_for_generation); ``actor``: the module whose weights the engine syncs;
        ``plan``: run.memory_plan.OffloadPlan (None: the *_offload keys alone); ``new_engine()``: a
        fresh engine (collective; start_engine) for a restart in place (None: no restarts)."""
        from megatron_rl.run.memory_plan import config_plan

        super().__init__()
        self.plan = plan or config_plan(cfg)
        self.cfg, self.ps, self.data, self.actor, self.park = cfg, ps, data, actor, park
        self.engine, self.draw, self.new_engine = engine, draw, new_engine
        self.engine_restarts = 0  # over the run (logged as rollout/engine_restarts)
        self.parking = HostParking(ps.device)
        self.trained = 0  # the actor's version, which the engine samples with once synced
        self.weights_stale = True  # the engine starts without the actor's weights
        # multi_turn.enable: episodes of turns with tools / a simulated user (rollout/agent_loop.py)
        self.agent, self.episode_stats = make_agent(cfg, ps, tokenizer)

    def start(self, step: int) -> None:
        self.trained, self.weights_stale = step, True

    def prompts(self, step: int) -> list[int]:
        return self.asked[step][0] if step in self.asked else self.draw()  # queued by a separate rollout

    def generate(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None = None
    ) -> tuple[list[list[Generation]], int]:
        """``items``: the prompts' data.PromptItem rows (a multi-turn episode reads its tools_kwargs,
        interaction_kwargs and chat messages from them). An engine that died (its worker or the
        connection to it gone: rollout.base.EngineDied, raised as EngineFailure on every rank it serves)
        is restarted in place up to rollout.engine_restarts times per step; any other error propagates."""
        queued = self._queued(tag)
        if queued is not None:
            return queued
        allowed = self.cfg.actor_rollout_ref.rollout.engine_restarts if self.new_engine else 0
        for attempt in range(allowed + 1):
            gens, error = self._generate_once(tag, prompt_ids, params, timer, items)
            if not self._failed_anywhere(error):
                break
            if attempt == allowed:
                raise error or RuntimeError(
                    f"{tag}: the rollout engine failed on another rank (its log has the cause)"
                )
            self._restart_engine(tag, error, attempt + 1, allowed, timer)
        assert gens is not None  # no rank failed on the last attempt
        rollout = self.cfg.actor_rollout_ref.rollout
        if rollout.free_cache_engine:
            with timer("engine"):
                # SGLang drops its weights with its memory: the next rollout streams them again.
                self.engine.release_memory()
            self.weights_stale = True
        with timer("offload"):
            self.parking.reload()
        return gens, self.trained

    def _failed_anywhere(self, error: EngineFailure | None) -> bool:
        """Whether the engine failed on any training rank (collective over every one of them)."""
        flag = torch.tensor([0.0 if error is None else 1.0], device=self.ps.device)
        for group in (self.ps.mp_group, self.ps.dp_group):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _restart_engine(self, tag: str, error: EngineFailure | None, n: int, allowed: int, timer) -> None:
        """Every rank's engine shut down and started again (collective: an engine of rollout TP > 1
        spans ranks); the weights stream into it on the next attempt."""
        ps = self.ps
        if error is not None and error.rank == ps.global_rank:  # one line, from the rank that hosts it
            cause = " ".join(error.cause.split())[:300]
            print(
                f"megatron-rl: {tag}: the rollout engine on rank {error.rank} failed ({cause}); restarting "
                f"every rank's engine in place ({n} of {allowed}: actor_rollout_ref.rollout."
                "engine_restarts), syncing the weights again and generating the step again",
                flush=True,
            )
        with timer("engine"):
            self.parking.reload()  # the actor's parameters back on the device for the sync
            try:
                self.engine.shutdown()
            except Exception:  # a crashed engine may not shut down cleanly; its replacement starts anyway
                pass
            assert self.new_engine is not None
            self.engine = self.new_engine()
        self.weights_stale = True
        self.engine_restarts += 1

    def _generate_once(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None
    ) -> tuple[list[list[Generation]] | None, EngineFailure | None]:
        """Park, resume the engine, sync the weights if stale, generate: (generations, None), or (None,
        the failure) when the generator failed (rollout.base.EngineFailure; anything else, out of
        memory and a failed sync check included, is raised: a restart would not cure it)."""
        from megatron_rl.rollout.reshard import sync_weights

        ps, rollout = self.ps, self.cfg.actor_rollout_ref.rollout
        free = rollout.free_cache_engine
        with timer("offload"):
            self.park(self.parking)
        if free:
            with timer("engine"):  # the engine's memory comes back (and training's cache goes)
                if ps.device.type == "cuda":
                    torch.cuda.empty_cache()  # training's cached blocks go back to the device
                self.engine.resume_memory()
        if self.weights_stale:
            with timer("reshard"):
                bucket_mb, dtype = rollout.update_weights_bucket_megabytes, engine_dtype(rollout.dtype, ps)
                synced = sync_weights(self.actor, ps, self.engine, bucket_mb, dtype)
            timer.add("reshard_check", synced["check_seconds"])  # the integrity check's share of it
            self.weights_stale = False
        if self.plan.parks("actor", "params"):
            with timer("offload"):
                self.parking.park(self.actor.parameters())
        with timer("gen"):
            try:
                if self.agent is None:
                    gens = self.engine.generate(prompt_ids, params)
                else:
                    gens = self.agent.run(self.engine, prompt_ids, params, items)
            except EngineFailure as e:  # raised on every rank the failed generator serves
                return None, e
            if self.agent is not None and tag.startswith("train/"):
                self.episode_stats.add(gens)
        return gens, None

    def policy_updated(self, step: int, timer) -> None:
        self.trained, self.weights_stale = step, True

    def step_metrics(self, step: int) -> dict[str, float]:
        """perf/parked_gb and perf/offload/* (run.memory_plan); multi_turn/*: the episodes of this step's
        training rollouts (rollout/agent_loop.EpisodeStats)."""
        out = self.plan.metrics(self.parking.last_parked_bytes)
        if self.engine_restarts:
            out["rollout/engine_restarts"] = float(self.engine_restarts)
        return out if self.agent is None else {**out, **self.episode_stats.pop(self.ps)}

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.shutdown()
        self.engine.shutdown()


class SeparateRollout(_Queue):
    """Engines on ranks of their own, up to ``rollout.max_staleness`` steps ahead of training."""

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        data: RolloutData,
        actor: torch.nn.Module,
        placement,
        draw: Callable[[], list[int]],
        total_steps: int,
    ):
        """``placement``: the job's config.placement.Placement (the rollout ranks and engines)."""
        from megatron_rl.roles.remote_rollout import RolloutClient

        super().__init__()
        rollout = cfg.actor_rollout_ref.rollout
        self.cfg, self.ps, self.data, self.actor, self.draw = cfg, ps, data, actor, draw
        self.total_steps, self.staleness = total_steps, rollout.max_staleness
        self.client = RolloutClient(
            ps, placement, rollout.tensor_model_parallel_size, cfg.trainer.dist_timeout_minutes
        )
        self.pushed = 0  # the weights the engines hold once they reach the next request
        self.trained = 0  # the actor's version
        self._val = 0

    def _push(self, step: int) -> None:
        rollout = self.cfg.actor_rollout_ref.rollout
        dtype = engine_dtype(rollout.dtype, self.ps)
        self.client.push_weights(self.actor, rollout.update_weights_bucket_megabytes, dtype)
        self.pushed = step

    def _ask(self, step: int) -> None:
        # Up to `staleness` steps past the last are asked for too: the run's final checkpoint then holds
        # the queue a longer run would have had, so resuming it to more steps repeats that run exactly.
        if step > self.total_steps + self.staleness or step in self.asked:
            return
        indices = self.draw()
        self.asked[step] = (indices, self.pushed)  # served after every weights request posted so far
        prompts = [self.data.train[i].prompt_ids for i in indices]
        self.client.request(f"train/{step}", prompts, self.sampling(step, validate=False))

    def start(self, step: int) -> None:
        self.trained = step
        self._push(step)
        for k in range(step + 1, step + 2 + self.staleness):
            self._ask(k)

    def prompts(self, step: int) -> list[int]:
        self._ask(step)  # only at a resume whose queue did not reach this step
        return self.asked[step][0]

    def generate(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None = None
    ) -> tuple[list[list[Generation]], int]:
        with timer("gen"):  # with staleness > 0 mostly done: the engines ran while the last step trained
            if tag.startswith("train/"):
                step = int(tag.split("/")[1])
                if step not in self.ready:
                    self.ready[step] = self.client.receive(tag, len(prompt_ids))
                queued = self._queued(tag)
                if queued is None:
                    raise RuntimeError(f"{tag} was never asked for (SeparateRollout.prompts asks)")
                return queued
            if self.pushed != self.trained:  # validation after the last step: its weights
                self._push(self.trained)
            self._val += 1
            tag = f"{tag}/{self._val}"
            self.client.request(tag, prompt_ids, params)
            out = self.client.receive(tag, len(prompt_ids))
            self.client.engine_seconds.pop(tag, None)
            return out, self.pushed

    def policy_updated(self, step: int, timer) -> None:
        """After step ``step``'s update: stream version ``step``, ask for step + 1 + staleness."""
        self.trained = step
        if step >= self.total_steps:
            return
        with timer("reshard"):  # waits for the generation in progress (the engines load between requests)
            self._push(step)
            self._ask(step + 1 + self.staleness)

    def step_metrics(self, step: int) -> dict[str, float]:
        """perf/rollout_engine_busy_s: seconds the engines spent generating this step's samples (absent for
        generations from a resumed queue). With the step time it gives the rollout GPUs' idle share."""
        busy = self.client.engine_seconds.pop(f"train/{step}", None)
        return {} if busy is None else {"perf/rollout_engine_busy_s": busy}

    def _take_all(self) -> None:
        for step in sorted(self.asked):
            if step not in self.ready:
                self.ready[step] = self.client.receive(f"train/{step}", len(self.asked[step][0]))

    def shutdown(self) -> None:
        self.client.stop()
