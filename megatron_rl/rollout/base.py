"""The rollout-engine protocol, sampling parameters, and the collective plumbing every engine shares.

Data flow of one rollout, seen from the trainer (every rank runs the same code):

    engine.resume_memory()                              # GPU engines re-map weights + KV cache
    sync_weights(actor, ps, engine, bucket_mb, dtype)   # rollout.reshard: the one weight path
    gens = engine.generate(my_dp_prompts, params)       # collective; gens[i] has params.n entries
    engine.release_memory()                             # give the GPU back to training

``generate`` is collective: every rank passes the prompts of its data-parallel shard (identical on
the TP/PP peers of one DP replica) and gets back the generations for exactly those prompts. Inside,
only the *DP leader* of each replica (tp_rank 0, pp_rank 0, the lowest global rank of the
model-parallel group) submits its prompts to a generator; the generator's results are broadcast
over the model-parallel group, so TP/PP peers always hold identical responses. Which rank runs the
generator is the engine's business (:func:`collective_generate` does the routing):

* HF engine: every DP leader runs its own transformers model (a rollout group of one rank).
* SGLang engine: the first rank of each rollout group (rollout TP x rollout DP ranks) hosts an
  ``sglang.Engine`` and generates for the DP leaders inside its group.

``update_weights`` is collective too: the bucket iterator drives the collectives of the reshard
stream, so every engine, on every rank, must exhaust it (ranks that host no model just drop the
buckets). The tensors of a bucket are views into a buffer that is reused for the next bucket: an
engine copies or loads them before asking for the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist

from megatron_rl import seeds

if TYPE_CHECKING:
    from megatron_rl.parallel import ParallelState


@dataclass
class SamplingParams:
    """How to sample; the same fields drive every engine."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep the top_k most likely tokens (-1 = all)."""
    max_new_tokens: int = 512
    """Most tokens generated per response (data.max_response_length)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation of a response ends after any of these (included in the response). The set is
    complete: the model config's EOS is not added implicitly."""
    greedy: bool = False
    """Argmax decoding (also implied by temperature == 0)."""
    return_logprobs: bool = False
    """Also return the engine's log-probability of each generated token."""
    seed: int | None = None
    """Run seed (actor_rollout_ref.rollout.seed); None: the engine draws fresh randomness. Each response's
    sampling seed is :func:`sample_seed` of (seed, step, dp_rank, row, validate); the HF engine is
    reproducible given it."""
    step: int = 0
    """Training step of this rollout (part of every row's sampling seed)."""
    validate: bool = False
    """A validation rollout: its seeds are kept apart from the training rollout of the same step."""
    return_routed_experts: bool = False
    """MoE: also return the experts each token was routed to (routing replay, models/routing.py)."""

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def check(self) -> None:
        """Refuse out-of-range fields, naming the config key (``validate`` is the field above)."""
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1 (actor_rollout_ref.rollout.n)")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1 (data.max_response_length)"
            )
        if self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature} must be >= 0 (actor_rollout_ref.rollout.temperature)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (actor_rollout_ref.rollout.top_p)")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1 (actor_rollout_ref.rollout.top_k)")


SEED_BITS = seeds.BITS
"""``sample_seed`` range: [0, 2**63), what ``torch.Generator.manual_seed`` takes as a non-negative int64."""
SGLANG_SEED_BITS = 31
"""SGLang batches the per-request ``sampling_seed`` into an int32 tensor: [0, 2**31) is all it takes."""


def sample_seed(seed: int, step: int, dp_rank: int, row: int, validate: bool, bits: int = SEED_BITS) -> int:
    """The sampling seed of one response (megatron_rl.seeds.SAMPLE) in [0, 2**bits).

    ``dp_rank`` is the data-parallel rank whose prompts the row belongs to (the slice index with a
    separate rollout) and ``row`` the response's index in that rank's list of prompt x n rows (prompt i,
    sample j -> row i*n + j). At 63 bits a run's few million seeds stay distinct with overwhelming
    probability; SGLang's ``bits=31`` is the same hash folded to its int32 range.
    """
    return seeds.derive(seeds.SAMPLE, seed, step, dp_rank, row, validate, bits=bits)


@dataclass
class Generation:
    """One sampled response."""

    token_ids: list[int]
    """Response tokens only; ends with the stop token when one was produced."""
    logprobs: list[float] | None
    """Engine log-probabilities of ``token_ids`` (when asked), one per token."""
    finish_reason: Literal["stop", "length"]
    """"stop": a stop token ended the response; "length": max_new_tokens was reached."""
    response_mask: list[int] | None = None
    """Multi-turn episodes: 1 on the model's tokens, 0 on the tool/user tokens between its turns (one per
    token of ``token_ids``); None: every token is the model's."""
    info: dict | None = None
    """Multi-turn episodes: num_turns, tool_calls, tool_errors, tool_timeouts, tool_rewards, turn_scores
    (see rollout/agent/agent_loop.py)."""
    routed_experts: torch.Tensor | None = None
    """With ``return_routed_experts``: [prompt + response - 1, L, k] int16, the experts each token the
    engine read (prompt, then response but its last token) went to in each decoder layer; -1 on dense
    layers."""
    versions: list[int] | None = None
    """Partial rollouts: the policy version that sampled each token of ``token_ids`` (an episode carried
    across steps holds several); None: the version the rollout role records for the whole batch."""


Bucket = list[tuple[str, torch.Tensor]]


class RolloutEngine(Protocol):
    dtype: torch.dtype
    """Weight dtype the engine expects from the reshard stream."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """Collective: this rank's DP shard of prompts -> ``params.n`` generations per prompt."""
        ...

    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        """Collective: load full HF-named tensors; must exhaust ``buckets`` on every rank."""
        ...

    def release_memory(self) -> None:
        """Free the engine's device memory (weights and KV cache) for training."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back; weights must be synced again before the next generate."""
        ...

    def shutdown(self) -> None: ...


def stop_token_ids(tokenizer, model_dirs: Iterable[str]) -> list[int]:
    """Where responses end: the ``eos_token_id`` of the model's ``generation_config.json`` (an id or a
    list; the first of ``model_dirs`` that has the file), then the tokenizer's EOS, without repeats.

    Chat models often end a turn with a token that is not the tokenizer's EOS (a ChatML model whose
    tokenizer EOS is ``<|endoftext|>`` ends turns with ``<|im_end|>``, which its generation config
    names); stopping at the tokenizer's EOS alone would let responses run past the end of the turn.
    """
    import json
    import os

    ids: list[int] = []
    for d in model_dirs:
        path = os.path.join(d, "generation_config.json") if d else ""
        if path and os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos]
            break
    eos = tokenizer.eos_token_id
    ids += eos if isinstance(eos, list) else [eos]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


class RolloutOOMError(RuntimeError):
    """Generation ran out of device memory; the message names the numbers and the keys to lower."""


def oom_message(
    what: str,
    num_prompts: int,
    n: int,
    max_prompt_len: int,
    max_new_tokens: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
) -> str:
    """The error text of a rollout OOM: what was asked, what the engine had, which keys to lower."""
    seqs = num_prompts * n
    tokens = seqs * (max_prompt_len + max_new_tokens)
    mem = ""
    if total_bytes and free_bytes is not None:
        mem = f"; GPU memory {free_bytes / 2**30:.1f} GiB free of {total_bytes / 2**30:.1f} GiB"
    return (
        f"Out of memory during rollout ({what}): {num_prompts} prompts x n={n} = {seqs} sequences of up to "
        f"{max_prompt_len} prompt + {max_new_tokens} response tokens ({tokens} tokens), "
        f"gpu_memory_utilization={gpu_memory_utilization}, max_num_batched_tokens={max_num_batched_tokens}"
        f"{mem}. Lower data.max_response_length, actor_rollout_ref.rollout.gpu_memory_utilization "
        f"(leaves more room outside the engine's static pool) or "
        f"actor_rollout_ref.rollout.max_num_batched_tokens, or use more data-parallel ranks."
    )


# --------------------------------------------------------------------------------------------------
# Collective plumbing
# --------------------------------------------------------------------------------------------------


def object_group(ps: ParallelState, partition: list[list[int]]) -> dist.ProcessGroup:
    """A gloo group over this rank's block of ``partition`` (disjoint rank lists covering the
    world), for small Python objects (prompts, results, IPC handles) next to the NCCL traffic.

    Collective over the world: every rank passes the same partition.
    """
    if ps.world_size == 1:
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("object_group needs torch.distributed initialized (parallel.init_parallel)")
        return world
    mine, _ = dist.new_subgroups_by_enumeration(partition, backend="gloo")
    return mine


def gloo_twin(ps: ParallelState, group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself on a gloo world; otherwise a gloo group with the same members (collective)."""
    ps.check_current()
    if ps.backend == "gloo":
        return group
    ranks = sorted(dist.get_process_group_ranks(group))
    blocks: list = [None] * ps.world_size
    dist.all_gather_object(blocks, ranks)
    return object_group(ps, [list(b) for b in sorted({tuple(b) for b in blocks})])


Origins = list[tuple[int, int]]
"""Per prompt of a ``run`` call: (dp_rank that passed it, its index in that rank's prompts); with
``params.n`` the (dp_rank, row) of each response, the inputs of :func:`sample_seed`."""


Contribution = tuple[int, list[list[int]]] | None
"""What one rank of a rollout group sends its rank 0: (dp_rank, prompts) from a DP leader, None from
the other ranks."""


def row_seeds(params: SamplingParams, origins: Origins, fallback: int, bits: int = SEED_BITS) -> list[int]:
    """One sampling seed per response row (prompt-major: prompt k's samples are rows k*n .. k*n+n-1).

    ``fallback`` stands in for ``params.seed`` when it is None (an engine-chosen seed per call).
    """
    seed = fallback if params.seed is None else params.seed
    n = params.n
    return [
        sample_seed(seed, params.step, dp, i * n + j, params.validate, bits)
        for dp, i in origins
        for j in range(n)
    ]


def collective_generate(
    ps: ParallelState,
    prompts: list[list[int]],
    params: SamplingParams,
    rollout_group: dist.ProcessGroup | None,
    mp_group: dist.ProcessGroup,
    run: Callable[[list[list[int]], Origins], list[list[Generation]]] | None,
) -> list[list[Generation]]:
    """Route prompts to the generator of this rank's rollout group and results back.

    1. DP leaders send their prompts (with their dp_rank) to rank 0 of their rollout group (gloo gather);
    2. that rank calls ``run(flat, origins)`` once on the concatenation (``run`` is None on the other
       ranks); ``origins`` says where each prompt came from, for the per-row seeds (:func:`row_seeds`);
    3. results go back to the DP leaders (scatter) and from there to their TP/PP peers (broadcast
       over the model-parallel group).
    """
    params.check()
    ps.check_current()  # an engine built on groups megatron has since destroyed must not use them
    mine = (ps.dp_rank, list(prompts)) if ps.is_dp_leader else None
    # rollout_group None (or of one rank): this rank generates for itself
    group = rollout_group if rollout_group is not None and dist.get_world_size(rollout_group) > 1 else None
    peers = mp_group if ps.tp_size * ps.pp_size > 1 else None
    result = on_host(mine, group, peers, lambda gathered: _generate_for_group(gathered, run))
    if isinstance(result, _Failed):  # every rank the generator serves raises, past the collectives
        raise EngineFailure(result.rank, result.cause)
    if result is None:  # a DP leader always receives a list; its TP/PP peers get it by the broadcast
        raise RuntimeError(f"rank {ps.rank} received no results from its data-parallel leader")
    if len(result) != len(prompts):
        raise RuntimeError(
            f"rank {ps.rank} passed {len(prompts)} prompts but its DP leader passed {len(result)}: "
            "TP/PP peers of one data-parallel replica must pass identical prompts to generate()"
        )
    return result


def on_host(
    mine: Any,
    group: dist.ProcessGroup | None,
    peers: dist.ProcessGroup | None,
    run_for: Callable[[list[Any]], list[Any]],
) -> Any:
    """Collective: every DP leader's ``mine`` (None on the other ranks) to the rank hosting the group's
    engine (rank 0 of ``group``; None: this rank hosts its own), ``run_for(contributions)`` there (one
    piece per contribution, in order), each leader's piece back to it, then to its TP/PP ``peers``
    (None: it has none)."""
    if group is None:
        result = run_for([mine])[0]
    else:
        host = dist.get_global_rank(group, 0)
        gathered: list[Any] | None = None
        if dist.get_rank(group) == 0:
            gathered = [None] * dist.get_world_size(group)
        dist.gather_object(mine, gathered, dst=host, group=group)
        pieces = None if gathered is None else run_for(gathered)
        got: list[Any] = [None]
        dist.scatter_object_list(got, pieces, src=host, group=group)
        result = got[0]
    if peers is not None:
        box = [result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(peers, 0), group=peers)
        result = box[0]
    return result


class EngineDied(RuntimeError):
    """The engine's worker process, or the connection to it, is gone: raised by an engine where it sees
    that (SGLang: a worker process exited, its pipe or socket closed). The one failure of ``generate``
    the ranks it serves are told about, to raise :class:`EngineFailure` together after the collectives
    and have the rollout restart the engine in place (roles.rollout); any other error in generation (a
    bug, a bad input, out of memory) propagates with its own message, without a restart."""


class EngineFailure(RuntimeError):
    """The generator serving this rank failed (raised by ``generate`` on every rank it serves, so that
    they leave the collectives together); ``rank``: the global rank hosting it."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(cause)
        self.rank, self.cause = rank, cause

    @classmethod
    def of(cls, died: EngineDied) -> EngineFailure:
        """What the ranks served by this rank's engine raise when it died (``died``, seen here)."""
        return cls(dist.get_rank() if dist.is_initialized() else 0, f"{type(died).__name__}: {died}")


@dataclass
class _Failed:
    """In place of the generations when the generator failed."""

    rank: int
    cause: str


def _generate_for_group(
    contributions: list[Contribution],
    run: Callable[[list[list[int]], Origins], list[list[Generation]]] | None,
) -> list:
    """On rank 0 of a rollout group: ``run`` once on the concatenated prompts, cut back into one piece
    per contribution (None for a rank that sent None); a :class:`_Failed` for each when ``run`` failed
    (out of memory excepted: that is raised)."""
    flat = [p for c in contributions if c for p in c[1]]
    origins = [(c[0], i) for c in contributions if c for i in range(len(c[1]))]
    if not flat:
        out: list[list[Generation]] = []
    elif run is None:
        raise RuntimeError("this rank leads a rollout group but hosts no generator")
    else:
        try:
            out = run(flat, origins)
        except RolloutOOMError:
            raise
        except EngineDied as e:
            failure = EngineFailure.of(e)
            return [_Failed(failure.rank, failure.cause)] * len(contributions)
    if len(out) != len(flat):
        raise RuntimeError(f"engine returned {len(out)} results for {len(flat)} prompts")
    return split_back(contributions, out)


def split_back(contributions: list, out: list) -> list:
    """The host's results ``out`` for the prompts of ``contributions`` concatenated (each None or a tuple
    whose second item is its prompts), cut back into one piece per contribution (None for None)."""
    pieces: list = []
    pos = 0
    for c in contributions:
        k = len(c[1]) if c else 0
        pieces.append(out[pos : pos + k] if c is not None else None)
        pos += k
    return pieces
