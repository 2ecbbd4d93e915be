"""The rollout batch: one typed record that flows through a PPO step.

Shapes (B sequences on this data-parallel rank, P prompt tokens, R response tokens):

    prompts         [B, P]  left padded with pad_token_id
    responses       [B, R]  right padded after EOS
    input_ids       [B, P+R]
    attention_mask  [B, P+R] 1 on real prompt and response tokens
    response_mask   [B, R]  float, 1 on the response tokens trained on: the model's (EOS included); 0 on
                            padding and, in multi-turn episodes, on the tool/user tokens between turns
                            (those stay in attention_mask: the model reads them, it is not trained on them)

Fields filled as the step proceeds: rollout_log_probs (the engine's, when kept), old_log_probs,
ref_log_probs, values (each [B, R]), token_level_scores / token_level_rewards / advantages / returns and
rollout_is_weights (mismatch correction) ([B, R]); with routing replay, routed_experts [B, P+R, L, k] (the
engine's experts per token and layer, aligned with input_ids). Per-sequence host data
(uid of the prompt group, data_source, ground truth, extra_info) lives in ``meta``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

_TENSOR_FIELDS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "response_mask",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
    "rollout_log_probs",
    "rollout_is_weights",
)


_ROW_FIELDS = (*_TENSOR_FIELDS, "response_index", "routed_experts")
"""Every per-row tensor of a batch (what select and to carry)."""


@dataclass
class SeqMeta:
    """Host-side data of one sequence."""

    uid: str
    """Prompt id shared by the rollout.n samples of one prompt (GRPO/RLOO groups)."""
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)
    messages: Any = None
    """The prompt's chat messages (for a reward model that re-renders the conversation)."""
    reward_extras: dict[str, float] = field(default_factory=dict)
    """The numeric keys besides "score" that the reward function returned for this sequence."""
    pred: Any = None
    """The reward function's "pred" when it is not a number (a string answer, hashable): the vote
    of validation's maj@k (reward.scoring.ValidationScores); a numeric pred is in reward_extras."""
    policy_version: int = 0
    """The step whose updated weights generated this sequence (0: the initial weights); with partial
    rollouts the oldest of its model tokens' versions."""
    token_versions: list[int] | None = None
    """Partial rollouts: the policy version of each response token (rollout.Generation.versions)."""


@dataclass
class RolloutBatch:
    prompts: torch.Tensor
    responses: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    meta: list[SeqMeta]
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    response_index: torch.Tensor | None = None
    """Compacted micro-batches only (:meth:`compacted`): [B, R] position predicting each response token."""
    routed_experts: torch.Tensor | None = None
    """MoE with routing replay: [B, P+R, L, k] int16, the engine's experts for each token of input_ids in
    each of the L decoder layers; -1 where it recorded none (models/routing.py)."""

    @classmethod
    def from_tokens(
        cls,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        meta: list[SeqMeta],
        response_attention: torch.Tensor | None = None,
    ) -> RolloutBatch:
        """Assemble from left-padded prompts [B, P] and right-padded responses [B, R];
        ``response_attention`` [B, R]: the real response tokens when they are more than the trained ones
        (multi-turn), else ``response_mask``."""
        real = response_mask if response_attention is None else response_attention
        return cls(
            prompts=prompts,
            responses=responses,
            input_ids=torch.cat([prompts, responses], dim=1),
            attention_mask=torch.cat([prompt_mask.long(), real.long()], dim=1),
            response_mask=response_mask.float(),
            meta=meta,
        )

    @classmethod
    def from_generations(
        cls, items: list, generations: list, pad_id: int, max_response_length: int, uid_prefix: str
    ) -> RolloutBatch:
        """Prompts (data.PromptItem) and their engine generations (n per prompt) -> [B*n] rows: a prompt's
        samples are adjacent and share the uid ``uid_prefix + item.index`` (the GRPO/RLOO group). When the
        engine returned log-probs, ``rollout_log_probs`` holds them (NaN where one is missing).

        A multi-turn episode (``g.response_mask`` set) keeps its tool/user tokens in the response with
        response_mask 0, and its sequence's extra_info gains verl's ``num_turns`` and
        ``rollout_reward_scores`` (calc_reward per tool), plus ``tool_rewards`` and ``turn_scores``.
        An agent-function episode (``info["prompt_ids"]``) has the prompt its session rendered, not the
        item's; its ``info["agent_reward"]`` is in extra_info and, when not None, counts as the
        episode's ``tool_reward`` (scored with multi_turn.tool_reward_weight)."""
        from megatron_rl.data import collate_left_pad

        prompts, metas, responses, logprobs, trained = [], [], [], [], []
        for it, samples in zip(items, generations, strict=True):
            for g in samples:
                own = None if g.info is None else g.info.get("prompt_ids")
                prompts.append(it if own is None else list(own))  # the session's prompt [P_i]
                responses.append(g.token_ids[:max_response_length])
                trained.append(None if g.response_mask is None else g.response_mask[:max_response_length])
                logprobs.append(g.logprobs)
                uid = f"{uid_prefix}{it.index}"
                extra = it.extra_info
                if g.info is not None:  # a copy per sample: the n samples of a prompt share its dict
                    agent = g.info.get("agent_reward")
                    extra = {
                        **extra,
                        "num_turns": g.info.get("num_turns", 1),
                        "rollout_reward_scores": dict(g.info.get("reward_scores", {})),
                        "tool_rewards": list(g.info.get("tool_rewards", [])),
                        "turn_scores": list(g.info.get("turn_scores", [])),
                        "tool_reward": float(g.info.get("tool_reward", 0.0)) + float(agent or 0.0),
                    }
                    if "agent_reward" in g.info:
                        extra["agent_reward"] = agent
                metas.append(SeqMeta(uid, it.data_source, it.ground_truth, extra, it.messages))
        prompt_ids, prompt_mask = collate_left_pad(prompts, pad_id)
        width = max(1, max(len(r) for r in responses))
        resp = torch.full((len(responses), width), pad_id, dtype=torch.long)
        resp_mask = torch.zeros(len(responses), width)
        resp_real = torch.zeros(len(responses), width)
        for i, (r, m) in enumerate(zip(responses, trained, strict=True)):
            resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            resp_real[i, : len(r)] = 1.0
            if m is None:
                resp_mask[i, : len(r)] = 1.0
            else:
                if len(m) != len(r):
                    raise ValueError(f"sequence {i}: response_mask has {len(m)} entries for {len(r)} tokens")
                resp_mask[i, : len(r)] = torch.tensor(m, dtype=torch.float32)
        batch = cls.from_tokens(prompt_ids, prompt_mask, resp, resp_mask, metas, resp_real)
        if any(lp is not None for lp in logprobs):
            lp = torch.full((len(responses), width), math.nan)
            for i, (r, got) in enumerate(zip(responses, logprobs, strict=True)):
                got = (got or [])[: len(r)]
                lp[i, : len(got)] = torch.tensor(got, dtype=torch.float32)
            batch.rollout_log_probs = lp
        routed = [g.routed_experts for samples in generations for g in samples]
        if any(r is not None for r in routed):
            batch.routed_experts = _routed_rows(
                routed, prompt_mask.sum(1).tolist(), [len(x) for x in responses], prompt_ids.shape[1], width
            )
        return batch

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.responses.shape[1]

    @property
    def response_positions(self) -> slice | torch.Tensor:
        """Decoder positions whose outputs predict the response tokens: P-1 .. S-2, or per row
        ``response_index`` [B, R] for a compacted batch."""
        if self.response_index is not None:
            return self.response_index
        return slice(self.prompts.shape[1] - 1, self.input_ids.shape[1] - 1)

    def compacted(self) -> RolloutBatch:
        """The same rows with each row's real tokens moved to the front: input_ids and attention_mask
        [b, L] (L: the longest prompt + response of these rows, right padded), every [b, R] field cut
        to the longest response, and ``response_index`` [b, r] giving the position that predicts each
        response token (prompt length - 1 + t). Masks must be contiguous (left-padded prompts,
        right-padded responses), as every batch built here is."""
        p, s = self.prompts.shape[1], self.input_ids.shape[1]
        keep = self.attention_mask.bool()
        p_len, r_len = keep[:, :p].sum(1), keep[:, p:].sum(1)  # [b]
        length = p_len + r_len
        width, r = int(length.max()), max(1, int(r_len.max()))
        cols = torch.arange(width, device=keep.device)[None]  # [1, L]
        real = cols < length[:, None]  # [b, L]
        src = ((p - p_len)[:, None] + cols).clamp(max=s - 1)  # where each kept token sits now
        kw: dict[str, Any] = {  # the [b, R] fields
            name: None if getattr(self, name) is None else getattr(self, name)[:, :r]
            for name in _TENSOR_FIELDS
            if name not in ("prompts", "input_ids", "attention_mask")
        }
        kw["prompts"] = self.prompts
        kw["input_ids"] = torch.where(real, self.input_ids.gather(1, src), 0)
        kw["attention_mask"] = real.to(self.attention_mask.dtype)
        if self.routed_experts is not None:  # [b, S, L, k] -> [b, L_width, L, k], moved as input_ids
            re = self.routed_experts
            moved = re.gather(1, src.to(re.device)[:, :, None, None].expand(-1, -1, *re.shape[2:]))
            kw["routed_experts"] = torch.where(real.to(re.device)[:, :, None, None], moved, -1)
        index = (p_len - 1)[:, None] + torch.arange(r, device=keep.device)[None]
        return RolloutBatch(meta=self.meta, response_index=index.clamp(0, width - 1), **kw)

    def select(self, index: torch.Tensor | list[int] | slice) -> RolloutBatch:
        """Rows ``index`` of every tensor (and of meta)."""
        if isinstance(index, slice):
            meta = self.meta[index]
        else:
            idx = index.tolist() if isinstance(index, torch.Tensor) else list(index)
            meta = [self.meta[i] for i in idx]
            index = torch.as_tensor(idx, dtype=torch.long)
        kw: dict[str, Any] = {}
        for name in _ROW_FIELDS:
            t = getattr(self, name)
            kw[name] = (
                None if t is None else t[index.to(t.device) if isinstance(index, torch.Tensor) else index]
            )
        return RolloutBatch(meta=meta, **kw)

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of ``size`` sequences (the last may be shorter)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    @classmethod
    def concat(cls, batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
        """Rows of ``batches`` one after another; prompts re-padded on the left, every [B, R] field on the
        right (tokens with ``pad_id``, the rest with 0: off the response mask)."""
        p = max(b.prompts.shape[1] for b in batches)
        r = max(b.response_length for b in batches)

        def cat(name: str, width: int, left: bool, value: float) -> torch.Tensor | None:
            parts = [getattr(b, name) for b in batches]
            if any(t is None for t in parts):
                return None
            padded = []
            for t in parts:
                extra = width - t.shape[1]
                padded.append(torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value))
            return torch.cat(padded)

        prompt_mask = torch.cat(
            [
                torch.nn.functional.pad(
                    b.attention_mask[:, : b.prompts.shape[1]], (p - b.prompts.shape[1], 0)
                )
                for b in batches
            ]
        )
        response_attention = torch.cat(
            [
                torch.nn.functional.pad(b.attention_mask[:, b.prompts.shape[1] :], (0, r - b.response_length))
                for b in batches
            ]
        )

        def cat_required(name: str, width: int, left: bool, value: float) -> torch.Tensor:
            t = cat(name, width, left, value)
            assert t is not None, f"RolloutBatch.{name} is always set"
            return t

        out = cls.from_tokens(
            cat_required("prompts", p, True, pad_id),
            prompt_mask,
            cat_required("responses", r, False, pad_id),
            cat_required("response_mask", r, False, 0),
            [m for b in batches for m in b.meta],
            response_attention,
        )
        for name in _TENSOR_FIELDS[5:]:
            setattr(out, name, cat(name, r, False, 0))
        routed = [b.routed_experts for b in batches]
        if all(x is not None for x in routed):  # each prompt part left padded, each response part right
            parts = []
            for b, x in zip(batches, routed, strict=True):
                assert x is not None
                lp = b.prompts.shape[1]
                parts.append(
                    torch.cat(
                        [  # [b, P_i | R_i, L, k] padded along dim 1 with -1 (nothing recorded)
                            torch.nn.functional.pad(x[:, :lp], (0, 0, 0, 0, p - lp, 0), value=-1),
                            torch.nn.functional.pad(
                                x[:, lp:], (0, 0, 0, 0, 0, r - b.response_length), value=-1
                            ),
                        ],
                        dim=1,
                    )
                )
            out.routed_experts = torch.cat(parts)
        return out

    def to(self, device: torch.device) -> RolloutBatch:
        names = _ROW_FIELDS
        kw: dict[str, Any] = {
            n: (None if getattr(self, n) is None else getattr(self, n).to(device)) for n in names
        }
        return dataclasses.replace(self, **kw)


def _routed_rows(
    routed: list, prompt_lengths: list[int], response_lengths: list[int], p: int, r: int
) -> torch.Tensor:
    """Per-sequence engine routing ([tokens read, L, k] or None) -> [B, p + r, L, k] aligned with
    input_ids (prompts left padded to ``p``, responses right padded to ``r``); -1 where nothing was
    recorded."""
    shape = next(x for x in routed if x is not None).shape[1:]
    out = torch.full((len(routed), p + r, *shape), -1, dtype=torch.int16)
    for i, (rows, lp, lr) in enumerate(zip(routed, prompt_lengths, response_lengths, strict=True)):
        if rows is None:
            continue
        n = min(rows.shape[0], lp + lr - 1)  # the last token is never read
        out[i, p - lp : p - lp + n] = rows[:n].to(torch.int16)
    return out
