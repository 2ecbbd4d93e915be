"""SGLang's generate results (``output_ids`` and ``meta_info``, skip_tokenizer_init) into the
project's :class:`~megatron_rl.rollout.base.Generation`: response ids ending with their stop token,
one log-prob per response token, and the routed experts routing replay (R3) trains on."""

from __future__ import annotations

import math

import torch

from megatron_rl.rollout.base import Generation


def to_generation(out: dict, return_logprobs: bool) -> Generation:
    """One result of ``sglang.Engine.generate`` (skip_tokenizer_init: ``output_ids`` and ``meta_info``)
    -> Generation, one log-prob per response token when ``return_logprobs``.

    ``meta_info["output_token_logprobs"]`` holds (logprob, token_id, text) per generated token. A stop
    token (``finish_reason == {"type": "stop", "matched": id}``) is a generated token: SGLang keeps it in
    both ``output_ids`` and ``output_token_logprobs``. Where ``output_ids`` lacks it (an engine that trims
    the matched stop from the ids), it is put back, with its log-prob when the engine listed it. A
    position the engine gave no log-prob for is NaN (counted as rollout_corr/missing_log_probs).
    """
    meta = out.get("meta_info", {})
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    ids = [int(t) for t in out["output_ids"]]
    matched = fr.get("matched") if isinstance(fr, dict) else None
    if kind == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
        ids.append(matched)  # the response ends with its stop token, as the trainer learns to stop
    logprobs = None
    if return_logprobs:
        entries = list(meta.get("output_token_logprobs") or [])[: len(ids)]
        for i, entry in enumerate(entries):
            if entry[1] is not None and int(entry[1]) != ids[i]:
                raise RuntimeError(
                    f"SGLang's output_token_logprobs names token {entry[1]} at response position {i} but "
                    f"output_ids has {ids[i]}: the log-probs would not belong to the response tokens"
                )
        logprobs = [math.nan if e[0] is None else float(e[0]) for e in entries] + [math.nan] * (
            len(ids) - len(entries)
        )
    return Generation(ids, logprobs, "stop" if kind == "stop" else "length")


def routed_experts(out: dict, layers: int, top_k: int) -> torch.Tensor:
    """``meta_info["routed_experts"]`` (base64 of int32 [prompt + output - 1, layers, top_k]: the experts
    of every token the engine read) -> that tensor as int16."""
    import base64

    import numpy as np

    raw = out.get("meta_info", {}).get("routed_experts")
    if raw is None:
        raise RuntimeError(
            "SGLang returned no routed_experts: actor_rollout_ref.actor.router_replay.mode=R3 needs an "
            "engine started with enable_return_routed_experts (an MoE model)"
        )
    ids = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    if ids.size % (layers * top_k):
        raise RuntimeError(
            f"SGLang's routed_experts has {ids.size} ids, not a multiple of {layers} x {top_k}"
        )
    return torch.from_numpy(ids.astype(np.int16)).view(-1, layers, top_k)
