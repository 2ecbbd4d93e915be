"""SGLang rollout engine (GPU): an in-process ``sglang.Engine`` per rollout group.

Layout. The world is cut into rollout groups of R = RolloutConfig.engine_ranks consecutive ranks
(``actor_rollout_ref.rollout.tensor_model_parallel_size`` x ``data_parallel_size``; R may differ from
the training TP). The first rank of each group creates an ``sglang.Engine(tp_size=R, base_gpu_id=<its
local GPU>)``, whose R scheduler processes run on the GPUs of the group's ranks, next to the trainer;
group rank g is the engine's TP rank g. Groups therefore have to sit inside one node. With
``data_parallel_size`` D > 1 the engine runs SGLang's DP attention (attention in D groups of R / D
ranks, the rest over all R); with ``expert_parallel_size`` EP > 1 engine rank g holds the contiguous
block of experts of its EP rank g // (R / EP), each cut over R / EP ranks (sglang_loader).

Start-up (:func:`start_sglang`): the trainer's NCCL communicators exist before the engine starts
(init_parallel binds the device; we also run one collective on each megatron group we use; on the H200,
a communicator created after the engine failed its first collective with ncclUnhandledCudaError), and
torchrun's RANK/WORLD_SIZE/MASTER_*/TORCHELASTIC_* variables are hidden from the engine's child processes
while it starts (:func:`torchrun_env_hidden` says why that edit is process-wide). The engine
reads only a config.json (written to a temporary directory from the model's config, EOS removed so that
``SamplingParams.stop_token_ids`` is the complete stop set) and starts with dummy weights: the first
:func:`~megatron_rl.rollout.reshard.sync_weights` fills it, and ``generate`` refuses to run before that.
Each start logs one line of the arguments that matter (:func:`engine_summary`); SGLang's own dump of
every argument goes to our logger at DEBUG (:class:`ServerArgsToDebug`).

Weights. Every rank of the group holds each full bucket on its own GPU (the reshard stream
broadcasts over PP). Each rank shares its bucket buffer with the SGLang worker on the same GPU through
a CUDA IPC handle (SGLang's "flattened_bucket" format: one tensor + per-tensor metadata); the group
leader gathers the R handles (gloo) and makes one ``update_weights_from_tensor`` call per bucket, so
no weight byte crosses GPUs here. A barrier keeps the peers' buffers untouched until the load ends.
A mixture-of-experts bucket goes to :mod:`megatron_rl.rollout.sglang_loader` (SGLang's custom weight
loader), which copies each stacked run of experts into the fused expert weights at once.

Generation. :func:`~megatron_rl.rollout.base.collective_generate` gathers the DP leaders' prompts of
the group at the engine host, which submits prompt x n requests in one ``generate`` call (n copies of
each prompt; the radix cache shares their prefix), and the results travel back. An out-of-memory
error becomes a :class:`~megatron_rl.rollout.base.RolloutOOMError` naming the sizes and the keys to lower.

Memory. ``release_memory`` frees weights, KV cache and CUDA graphs (torch_memory_saver);
``resume_memory`` maps them back, after which the weights must be synced again.

LoRA unmerged (rollout.lora_sync; the config.lora.EngineLora the engine is started with): the
engine starts with SGLang's LoRA support (``enable_lora``, ``max_lora_rank``, ``lora_target_modules``
as HF projections), :meth:`SGLangEngine.load_adapters` replaces the adapter ``lora_sync.ADAPTER``
(``unload_lora_adapter``, then ``load_lora_adapter_from_tensors``: full PEFT tensors, which SGLang
slices for its TP ranks), every request names it (``lora_path``), and ``release_memory`` keeps the
weights (only the KV cache and CUDA graphs go), so the frozen base streams once per engine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rl.model_args import DTYPES, ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.base import (
    SGLANG_SEED_BITS,
    Bucket,
    EngineDied,
    Generation,
    Origins,
    RolloutOOMError,
    SamplingParams,
    collective_generate,
    gloo_twin,
    object_group,
    oom_message,
    row_seeds,
)
from megatron_rl.rollout.checksums import CHECKSUM_SIZE

if TYPE_CHECKING:
    from megatron_rl.config.lora import EngineLora
from megatron_rl.rollout.sglang_loader import LOADER, READ_BACK, bucket_header, engine_expert_block
from megatron_rl.rollout.sglang_outputs import routed_experts, to_generation
from megatron_rl.rollout.sglang_start import child_pids, engine_arguments, start_sglang

log = logging.getLogger(__name__)


def _is_oom(text: str) -> bool:
    t = text.lower()
    return "out of memory" in t or "outofmemory" in t or "cuda oom" in t


class SGLangEngine:
    """See the module docstring."""

    def __init__(
        self,
        cfg,
        args: ModelArgs,
        ps: ParallelState,
        seed: int = 0,
        model_path: str | None = None,
        cuda_graph_max_bs: int | None = None,
        lora: EngineLora | None = None,
        **engine_kwargs,
    ) -> None:
        """Built by :func:`megatron_rl.rollout.create_engine`, which checks that ``ps`` is on a GPU.
        ``cuda_graph_max_bs``: see :func:`engine_arguments`; ``lora``: the actor's adapters come
        unmerged (config.lora.engine_lora_of); ``engine_kwargs`` override its dict."""
        self.cuda_graph_max_bs = cuda_graph_max_bs
        self.cfg, self.args, self.ps, self.seed = cfg, args, ps, seed
        self.model_path = model_path
        self.dtype = DTYPES[cfg.dtype]
        r = cfg.engine_ranks
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
        if ps.world_size % r or (local_world % r and ps.world_size > local_world):
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size = {r} must "
                f"divide the world size {ps.world_size} and the GPUs per node {local_world} (an engine "
                "lives in one node)"
            )
        self.group_size = r
        self.group_rank = ps.rank % r  # the engine's TP rank on this rank's GPU
        self.leader = ps.rank - self.group_rank
        ep = cfg.expert_parallel_size
        if ep > 1 and (not args.num_experts or args.num_experts % ep):
            raise ValueError(
                f"actor_rollout_ref.rollout.expert_parallel_size={ep} must divide the model's routed experts "
                f"({args.num_experts}; a dense model takes 1)"
            )
        self.experts = engine_expert_block(self.group_rank, r, ep, args.num_experts) if ep > 1 else None
        """The routed experts this rank's engine worker holds (None: all the model has)."""
        # Trainer communicators first: one collective on every group we use creates them eagerly.
        for g in (ps.tp_group, ps.pp_group, ps.dp_group, ps.mp_group):
            dist.all_reduce(torch.zeros(1, device=ps.device), group=g)
        self._group = object_group(ps, [list(range(k, k + r)) for k in range(0, ps.world_size, r)])
        self._mp_group = gloo_twin(ps, ps.mp_group)
        torch.cuda.synchronize()
        dist.barrier()
        self.engine = None
        self._config_dir: str | None = None
        self._workers: list[int] = []
        self.takes_adapters = self._lora_arguments(lora, args, engine_kwargs)
        self.adapter_base = False  # rollout.lora_sync: the base has been streamed into this engine
        self._adapter_loaded = False
        if self.group_rank == 0:
            self.engine = self._start(engine_kwargs)
        if r > 1:
            dist.barrier(group=self._group)  # peers wait until the engine is up
        self._synced = False
        self._released = False
        self._shapes: dict[str, list[int]] = {}  # every tensor streamed: its checkpoint shape
        self.unreadable: set[str] = set()  # streamed tensors the read-back does not find (logged once)

    @staticmethod
    def _lora_arguments(lora: EngineLora | None, args: ModelArgs, engine_kwargs: dict) -> bool:
        """Add SGLang's LoRA arguments to ``engine_kwargs`` when the actor's adapters come unmerged
        (``lora``); whether they do."""
        from megatron_rl.rollout.lora_sync import refusal, unsupported

        if lora is None:
            return False
        if (why := unsupported(args)) is not None:
            raise ValueError(refusal(why))
        engine_kwargs.setdefault("enable_lora", True)
        engine_kwargs.setdefault("max_lora_rank", lora.rank)
        engine_kwargs.setdefault("lora_target_modules", list(lora.hf_targets))
        engine_kwargs.setdefault("max_loras_per_batch", 2)  # the adapter and the base (SGLang's slot 0)
        return True

    def load_adapters(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Collective over the engine group: the actor's adapters (PEFT names, full tensors on this
        rank's GPU; ``config``: PEFT's adapter_config) replace the engine's (module docstring)."""
        from megatron_rl.rollout.lora_sync import ADAPTER

        if self.engine is not None:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
            torch.cuda.current_stream().synchronize()  # SGLang's workers read them from another process
            if self._adapter_loaded:
                out = self.engine.unload_lora_adapter(ADAPTER)
                if not out.success:
                    raise RuntimeError(f"SGLang could not unload the previous adapters: {out.error_message}")
                self._adapter_loaded = False
            out = self.engine.load_lora_adapter_from_tensors(ADAPTER, tensors, config)
            if not out.success:
                raise RuntimeError(f"SGLang rejected the actor's LoRA adapters: {out.error_message}")
            self._adapter_loaded = True
            self.engine.flush_cache()
        if self.group_size > 1:
            dist.barrier(group=self._group)  # the leader's tensors stay intact until the load ends

    def _start(self, engine_kwargs: dict):
        self._config_dir = config_dir = tempfile.mkdtemp(prefix="megatron_rl_sglang_")
        hf = dict(self.args.hf_config)
        hf["eos_token_id"] = None  # stopping is SamplingParams.stop_token_ids alone
        with open(os.path.join(config_dir, "config.json"), "w") as f:
            json.dump(hf, f)
        kwargs = engine_arguments(
            self.cfg, config_dir, self.group_size, self.ps.local_rank, self.seed, self.cuda_graph_max_bs
        )
        kwargs.update(engine_kwargs)
        before = child_pids()
        engine = start_sglang(kwargs, self.model_path or config_dir)
        self._workers = sorted(child_pids() - before)  # the engine's scheduler and detokenizer processes
        return engine

    def _gone(self, error: BaseException) -> str | None:
        """Why the engine is gone, if it is (a worker process exited, the connection to it closed): the
        cause of an :class:`EngineDied`; None for any other failure."""
        import psutil

        dead = []
        for pid in self._workers:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    dead.append(pid)
            except psutil.NoSuchProcess:
                dead.append(pid)
        if dead:
            return f"SGLang's worker process(es) {dead} exited ({type(error).__name__}: {error})"
        if isinstance(error, (ConnectionError, EOFError)):
            return f"the connection to SGLang's workers closed ({type(error).__name__}: {error})"
        return None

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        if self._released:
            raise RuntimeError(
                "update_weights() while the engine's memory is released: call resume_memory() first"
            )
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        monkey_patch_torch_reductions()  # IPC handles name GPUs by UUID, robust to CUDA_VISIBLE_DEVICES
        for bucket in buckets:
            self._shapes.update((name, list(t.shape)) for name, t in bucket)
            flat = getattr(bucket, "flat", None)
            if flat is None:  # a plain list of tensors: flatten it here
                flat = torch.cat([t.reshape(-1).to(self.dtype) for _, t in bucket])
            torch.cuda.current_stream().synchronize()  # the SGLang worker reads it from another process
            if getattr(bucket, "stacks", None):  # routed experts: sglang_loader copies them in whole
                load_format = LOADER
                payload = MultiprocessingSerializer.serialize([(bucket_header(bucket, self.experts), flat)])
            else:
                meta, off = [], 0
                for name, t in bucket:
                    n = t.numel()
                    meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, off, off + n, n))
                    off += n
                load_format = "flattened_bucket"
                payload = MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": meta})
            self._load_on_group(
                payload, load_format, f"SGLang rejected a weight bucket ({len(bucket)} tensors)"
            )
            del payload, flat
        if self.engine is not None:
            self.engine.flush_cache()
        self._synced = True

    @property
    def checks_weights(self) -> bool:
        """Every rank of the engine group reads its engine's copy back (:meth:`weight_checksums`)."""
        return True

    def weight_checksums(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Collective over the engine group: [CHECKSUM_SIZE] float64 checksums of the engine's copy of
        ``names``, computed by SGLang's workers (sglang_loader.read_back: each engine rank its shard's
        share, written into a buffer this rank shares with its worker) and summed over the group.
        Names no worker can place go to :attr:`unreadable` and are left out."""
        from sglang.srt.utils import MultiprocessingSerializer

        names = [n for n in names if n in self._shapes]
        k = CHECKSUM_SIZE
        out = torch.zeros(len(names), k + 1, dtype=torch.float64, device=self.ps.device)
        header = json.dumps({"names": names, "shapes": [self._shapes[n] for n in names]})
        payload = MultiprocessingSerializer.serialize([(header, out)])
        torch.cuda.current_stream().synchronize()
        self._load_on_group(payload, READ_BACK, "SGLang could not read its weights back for the sync check")
        got = out.cpu()  # every worker has written its share
        if self.group_size > 1:
            dist.all_reduce(got, group=self._group)
        placed = got[:, k] == self.group_size
        lost = [n for n, ok in zip(names, placed.tolist(), strict=True) if not ok]
        if lost and not set(lost) <= self.unreadable:
            self.unreadable.update(lost)
            log.warning(
                "megatron-rl: the sync check does not read %d tensor(s) back from SGLang (e.g. %s): their "
                "layout in the engine is not one it knows; the log-prob probe still covers them",
                len(lost), lost[:3],
            )  # fmt: skip
        return {n: got[i, :k] for i, n in enumerate(names) if placed[i]}

    def _load_on_group(self, payload: Any, load_format: str, failure: str) -> None:
        """Collective over the engine group: every rank's ``payload`` (one per engine rank) goes to the
        group's leader, whose engine takes them in one request; RuntimeError(``failure``: SGLang's
        reason) if it refuses. Returns once the engine is done, so each rank's buffers behind its
        payload stay intact until then and whatever the workers wrote into them is there."""
        payloads: list[Any] | None = [payload]
        if self.group_size > 1:
            payloads = [None] * self.group_size if self.group_rank == 0 else None
            dist.gather_object(payload, payloads, dst=self.leader, group=self._group)
        if self.engine is not None:
            ok, msg = self._load(payloads or [], load_format)
            if not ok:
                raise RuntimeError(f"{failure}: {msg}")
        if self.group_size > 1:
            dist.barrier(group=self._group)

    def _load(self, payloads: list, load_format: str) -> tuple[bool, str]:
        """One ``update_weights_from_tensor`` request with one serialized payload per engine rank (each
        rank's own bucket buffer: no weight byte crosses GPUs). ``Engine.update_weights_from_tensor``
        takes pre-serialized payloads for the flattened format only, so the request is built here."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        assert self.engine is not None  # called by the group's leader, which hosts the engine
        if load_format == "flattened_bucket":
            return self.engine.update_weights_from_tensor(
                named_tensors=payloads, load_format=load_format, flush_cache=False
            )
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=load_format, flush_cache=False
        )
        return self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_tensor(req, None)
        )

    def _memory_tags(self) -> list[str] | None:
        """What release_memory gives back: everything (None), or with unmerged LoRA all but the weights
        (the frozen base is kept; SGLang's adapter buffers live outside its memory saver)."""
        return ["kv_cache", "cuda_graph"] if self.takes_adapters else None

    def release_memory(self) -> None:
        if self.engine is not None and not self._released:
            self.engine.release_memory_occupation(self._memory_tags())
        self._released = True
        if not self.takes_adapters:
            self._synced = False  # SGLang does not keep the weights across a release
            self.adapter_base = False

    def resume_memory(self) -> None:
        if self.engine is not None and self._released:
            self.engine.resume_memory_occupation(self._memory_tags())
        self._released = False

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._config_dir:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            self._config_dir = None

    # -- generation ------------------------------------------------------------------------------

    def host_ready(self) -> None:
        """Raise unless this rank hosts the engine and it holds synced weights (what generating needs)."""
        if self.engine is None:
            raise RuntimeError("generation asked of a rank that hosts no SGLang engine")
        if self._released:
            raise RuntimeError("generate() while the engine's memory is released: call resume_memory() first")
        if not self._synced:
            raise RuntimeError(
                "generate() before update_weights(): the engine starts with dummy weights and drops them "
                "on release_memory(); call sync_weights first"
            )

    @property
    def event_loop(self):
        """The asyncio loop SGLang's tokenizer manager lives on (:meth:`generate_turn` runs there)."""
        self.host_ready()
        return self.engine.loop

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        run = None
        if self.engine is not None:
            self.host_ready()
            run = lambda flat, origins: self.generate_local(flat, origins, params)  # noqa: E731
        return collective_generate(
            self.ps, prompts, params, self._group if self.group_size > 1 else None, self._mp_group, run
        )

    def _sampling(self, params: SamplingParams, seed: int | None) -> dict:
        sp: dict[str, object] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.is_greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        else:
            sp["ignore_eos"] = True
        if seed is not None:
            sp["sampling_seed"] = seed  # honoured with SGLang's deterministic inference
        return sp

    def generate_local(
        self, prompts: list[list[int]], origins: Origins, params: SamplingParams
    ) -> list[list[Generation]]:
        """On the hosting rank: ``params.n`` generations of each prompt, in one engine call; ``origins``:
        each prompt's (dp_rank, row), which picks its sampling seeds."""
        rows = [p for p in prompts for _ in range(params.n)]
        # the rows of several DP leaders: origins keeps each row's (dp_rank, row) seed
        seeds = (
            row_seeds(params, origins, 0, SGLANG_SEED_BITS) if params.seed is not None else [None] * len(rows)
        )
        sampling = [self._sampling(params, s) for s in seeds]
        assert self.engine is not None  # generate() runs this only where the engine is hosted
        try:
            outs = self.engine.generate(
                input_ids=rows,
                sampling_params=sampling,
                return_logprob=params.return_logprobs,
                **self._request_extras(params, len(rows)),
            )
        except Exception as e:  # SGLang re-raises scheduler errors as plain exceptions
            if (err := self._failure(e, prompts, params)) is e:
                raise
            raise err from e
        gens = [self._to_generation(o, params, prompts) for o in outs]
        return [gens[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    async def generate_turn(
        self, prefix: list[int], params: SamplingParams, seed: int | None
    ) -> tuple[Generation, int | None]:
        """On :attr:`event_loop`: one request (a multi-turn episode's turn; SGLang batches the requests
        in flight); the Generation and the prompt tokens its prefix cache held (None: not reported)."""
        assert self.engine is not None
        extras = self._request_extras(params, 1)
        if "lora_path" in extras:  # one request: one name, not a list
            extras["lora_path"] = extras["lora_path"][0]
        try:
            out = await self.engine.async_generate(
                input_ids=prefix,
                sampling_params=self._sampling(params, seed),
                return_logprob=params.return_logprobs,
                **extras,
            )
        except Exception as e:
            if (err := self._failure(e, [prefix], params)) is e:
                raise
            raise err from e
        cached = out.get("meta_info", {}).get("cached_tokens")
        return self._to_generation(out, params, [prefix]), None if cached is None else int(cached)

    def _request_extras(self, params: SamplingParams, rows: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"return_routed_experts": True} if params.return_routed_experts else {}
        if self._adapter_loaded:  # LoRA unmerged: every request runs the actor's adapters
            from megatron_rl.rollout.lora_sync import ADAPTER

            extra["lora_path"] = [ADAPTER] * rows
        return extra

    def _failure(self, e: BaseException, prompts, params: SamplingParams) -> BaseException:
        """An exception of SGLang's generate as the rollout's error: an OOM, a dead engine, or itself."""
        if isinstance(e, RolloutOOMError):
            return e
        if isinstance(e, torch.OutOfMemoryError) or _is_oom(str(e)):
            return RolloutOOMError(self._oom(prompts, params, str(e)))
        if why := self._gone(e):
            return EngineDied(why)
        return e

    def _to_generation(self, out: dict, params: SamplingParams, prompts) -> Generation:
        fr = out.get("meta_info", {}).get("finish_reason") or {}
        if isinstance(fr, dict) and fr.get("type") == "abort":
            msg = str(fr.get("message", fr))
            if _is_oom(msg):
                raise RolloutOOMError(self._oom(prompts, params, msg))
            raise RuntimeError(f"SGLang aborted a request: {msg}")
        g = to_generation(out, params.return_logprobs)
        if params.return_routed_experts:
            g.routed_experts = routed_experts(out, self.args.num_layers, self.args.moe_top_k)
        return g

    def _oom(self, prompts, params: SamplingParams, detail: str) -> str:
        free, total = torch.cuda.mem_get_info(self.ps.device)
        msg = oom_message(
            "SGLang",
            len(prompts),
            params.n,
            max((len(p) for p in prompts), default=0),
            params.max_new_tokens,
            self.cfg.gpu_memory_utilization,
            self.cfg.max_num_batched_tokens,
            free,
            total,
        )
        return f"{msg} (engine said: {detail[:300]})"
