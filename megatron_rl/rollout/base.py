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
* SGLang engine: the first rank of each rollout-TP group hosts an ``sglang.Engine`` and generates
  for the DP leaders inside its group.

``update_weights`` is collective too: the bucket iterator drives the collectives of the reshard
stream, so every engine, on every rank, must exhaust it (ranks that host no model just drop the
buckets). The tensors of a bucket are views into a buffer that is reused for the next bucket: an
engine copies or loads them before asking for the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.distributed as dist

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
    """Sampling seed; the trainer passes seed + step. The HF engine is bit-reproducible given it."""

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def validate(self) -> None:
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
    (see rollout/agent_loop.py)."""


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
    if total_bytes:
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
        return dist.group.WORLD
    mine, _ = dist.new_subgroups_by_enumeration(partition, backend="gloo")
    return mine


def gloo_twin(ps: ParallelState, group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself on a gloo world; otherwise a gloo group with the same members (collective)."""
    if ps.backend == "gloo":
        return group
    ranks = sorted(dist.get_process_group_ranks(group))
    blocks: list = [None] * ps.world_size
    dist.all_gather_object(blocks, ranks)
    return object_group(ps, [list(b) for b in sorted({tuple(b) for b in blocks})])


def is_dp_leader(ps: ParallelState) -> bool:
    """The rank that speaks for its data-parallel replica (lowest global rank of its mp group)."""
    return ps.tp_rank == 0 and ps.pp_rank == 0


def collective_generate(
    ps: ParallelState,
    prompts: list[list[int]],
    params: SamplingParams,
    rollout_group: dist.ProcessGroup | None,
    mp_group: dist.ProcessGroup,
    run: Callable[[list[list[int]]], list[list[Generation]]] | None,
) -> list[list[Generation]]:
    """Route prompts to the generator of this rank's rollout group and results back.

    1. DP leaders send their prompts to rank 0 of their rollout group (gloo gather);
    2. that rank calls ``run`` once on the concatenation (``run`` is None on the other ranks);
    3. results go back to the DP leaders (scatter) and from there to their TP/PP peers (broadcast
       over the model-parallel group).
    """
    params.validate()
    lead = is_dp_leader(ps)
    # rollout_group None: this rank generates for itself (a group of one)
    rg_size = 1 if rollout_group is None else dist.get_world_size(rollout_group)
    rg_rank = 0 if rollout_group is None else dist.get_rank(rollout_group)
    mine = list(prompts) if lead else None
    if rg_size == 1:
        contributions = [mine]
    else:
        contributions = [None] * rg_size if rg_rank == 0 else None
        dist.gather_object(
            mine, contributions, dst=dist.get_global_rank(rollout_group, 0), group=rollout_group
        )
    if rg_rank == 0:
        flat = [p for c in contributions if c for p in c]
        if flat and run is None:
            raise RuntimeError("this rank leads a rollout group but hosts no generator")
        out = run(flat) if flat else []
        if len(out) != len(flat):
            raise RuntimeError(f"engine returned {len(out)} results for {len(flat)} prompts")
        pieces, pos = [], 0
        for c in contributions:
            k = len(c) if c else 0
            pieces.append(out[pos : pos + k] if c is not None else None)
            pos += k
    else:
        pieces = None
    if rg_size == 1:
        result = pieces[0]
    else:
        got: list = [None]
        dist.scatter_object_list(got, pieces, src=dist.get_global_rank(rollout_group, 0), group=rollout_group)
        result = got[0]
    if ps.tp_size * ps.pp_size > 1:
        box = [result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(mp_group, 0), group=mp_group)
        result = box[0]
    if len(result) != len(prompts):
        raise RuntimeError(
            f"rank {ps.rank} passed {len(prompts)} prompts but its DP leader passed {len(result)}: "
            "TP/PP peers of one data-parallel replica must pass identical prompts to generate()"
        )
    return result
