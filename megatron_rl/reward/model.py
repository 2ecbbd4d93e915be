"""Scores from a reward model held in Megatron shards (``build_model(args, ps, role="reward")``).

The reward model is the actor's trunk with HF's sequence-classification head: ``score`` =
``nn.Linear(H, 1, bias=False)`` applied at every position, of which HF keeps the last real token's.
Data flow of :func:`compute_rm_scores` (no grad; B sequences on this data-parallel rank, S positions):

    input_ids [B, S], attention_mask [B, S] (left and/or right padded; 1 = real token)
      -> last[B] = position of the last 1 of each row
      -> micro-batches of ``micro_batch_size`` rows (the last one filled up by repeating row 0,
         the pipeline needs one shape), through megatron's pipeline schedule (models.forward.run_pipeline:
         causal + key-padding mask, TP shards, PP p2p)
      -> last stage: scores per position [b, S, 1] -> scores[i, last[i]] -> [b]
      -> concatenated, cut to [B], float32, broadcast from the last pipeline stage to every stage.

Every TP rank of the last stage computes the same scores (the head is replicated over TP and its input
is complete there, gathered first under sequence parallelism). Data-parallel ranks score their own rows;
nothing is exchanged over DP.

Pooling at the last 1 of ``attention_mask`` equals HF's ``...ForSequenceClassification`` (which pools the
rightmost token that is not ``pad_token_id``) whenever no real token equals the pad id at the end of a
sequence; when the pad id doubles as EOS, HF would pool the token before a trailing EOS, this module the
EOS itself (the attention mask is the truth here, the pad id is not consulted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_rl.errors import NonFiniteRewardError
from megatron_rl.models.forward import broadcast_from_last_stage, run_pipeline
from megatron_rl.parallel import ParallelState
from megatron_rl.reward.source import RewardSource


@dataclass
class _ScoreMicroBatch:
    input_ids: torch.Tensor  # [b, S]
    attention_mask: torch.Tensor  # [b, S]
    last: torch.Tensor  # [b] position of each row's last real token


def last_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] keep-mask -> [B] index of the last 1 of each row (left or right padding alike)."""
    s = attention_mask.shape[1]
    idx = torch.arange(s, device=attention_mask.device)
    # the rightmost real position has the largest index among the kept ones; padding contributes -1
    return torch.where(attention_mask.bool(), idx, -1).amax(dim=1)


@torch.no_grad()
def compute_rm_scores(
    model: nn.Module,
    ps: ParallelState,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
) -> torch.Tensor:
    """Scalar reward-model scores [B] float32, on every rank: the score head's output at the last real
    token of each sequence (the last 1 of ``attention_mask``), as HF's ``logits[:, 0]``.

    ``model``: a ``role="reward"`` model from :func:`megatron_rl.models.builder.build_model`, filled by
    ``load_weights``. ``input_ids`` [B, S] in the reward model's own vocabulary; every row must hold at
    least one real token. Collective over the model's TP and PP groups.
    """
    role = getattr(getattr(model, "module", model), "role", None)
    if role != "reward":
        raise ValueError(f"compute_rm_scores needs a model built with role='reward', got role={role!r}")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both be [B, S]"
        )
    n = input_ids.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=ps.device)
    input_ids, attention_mask = input_ids.to(ps.device), attention_mask.to(ps.device)
    last = last_token_positions(attention_mask)  # [B]
    empty = (last < 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"rows {empty[:8]} of attention_mask have no real token; a reward model cannot score them"
        )

    # Fill the last micro-batch up to micro_batch_size rows with copies of row 0 (dropped afterwards).
    rows = torch.arange(n + (-n % micro_batch_size), device=input_ids.device)
    rows[n:] = 0
    ids, keep, pos = input_ids[rows], attention_mask[rows], last[rows]
    micro = [
        _ScoreMicroBatch(
            ids[i : i + micro_batch_size], keep[i : i + micro_batch_size], pos[i : i + micro_batch_size]
        )
        for i in range(0, len(rows), micro_batch_size)
    ]

    def per_micro_batch(mb: _ScoreMicroBatch, scores: torch.Tensor) -> torch.Tensor:
        # scores [b, S(+SP padding), 1] -> the last real token's [b]
        b = scores.shape[0]
        return scores[torch.arange(b, device=scores.device), mb.last, 0].float()

    outs = run_pipeline(model, ps, micro, per_micro_batch, forward_only=True)
    result = torch.cat(outs)[:n].contiguous() if ps.is_last_stage else None  # [B]
    return broadcast_from_last_stage(result, ps, (n,), torch.float32)


class ModelReward(RewardSource):
    """``reward_model.enable``: each response's score from the reward model, on every rank (the forward is
    collective over TP/PP, so unlike a reward function it does not run on one rank per replica: a
    ``collective`` reward source).

    When the reward model reads the actor's tokens (``tokenizer`` None: the same vocabulary and chat
    template), the rollout batch goes in as it is, and the score is taken at the last response token.
    Otherwise each conversation is rebuilt in the reward model's own format: the response is decoded with
    the actor's tokenizer (special tokens skipped), appended to the prompt's chat messages as the
    assistant's turn, rendered with the reward model's chat template and tokenizer, cut to its last
    ``max_length`` tokens (the score is read at the end), and right padded.
    """

    collective = True

    @property
    def name(self) -> str:
        return "reward model"

    def __init__(
        self,
        model: nn.Module,
        ps: ParallelState,
        micro_batch_size: int,
        actor_tokenizer,
        tokenizer=None,
        max_length: int | None = None,
    ) -> None:
        self.model, self.ps, self.micro_batch_size = model, ps, micro_batch_size
        self.actor_tokenizer, self.tokenizer, self.max_length = actor_tokenizer, tokenizer, max_length

    def __call__(self, batch) -> torch.Tensor:
        """[B] float32 scores on every rank for a RolloutBatch."""
        if self.tokenizer is None:
            ids, mask = batch.input_ids, batch.attention_mask
        else:
            ids, mask = self._retokenize(batch)
        dev = self.ps.device
        return compute_rm_scores(self.model, self.ps, ids.to(dev), mask.to(dev), self.micro_batch_size)

    def score_batch(self, batch, response_lengths: torch.Tensor):
        from megatron_rl.reward.source import RewardOutput

        scores = self(batch).float().cpu()
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:  # every rank of the replica holds the same scores, so each raises the same line
            i = bad[0]
            raise NonFiniteRewardError(
                f"the reward model scored row {i} (uid {batch.meta[i].uid!r}) {float(scores[i])} "
                f"({len(bad)} rows in all); look at reward_model.model.path (its weights)"
            )
        return RewardOutput(scores, {}, 0)

    def _retokenize(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = batch.response_mask.sum(-1).long().tolist()
        responses = batch.responses.cpu()
        texts = self.actor_tokenizer.batch_decode(
            [responses[i, :n].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
        )
        rows = []
        for meta, text in zip(batch.meta, texts, strict=True):
            messages = meta.messages
            if not isinstance(messages, list):  # a plain-text prompt
                messages = [{"role": "user", "content": str(messages)}]
            conversation = [*messages, {"role": "assistant", "content": text}]
            ids = self.tokenizer.apply_chat_template(conversation, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
            ids = list(ids)[-self.max_length :] if self.max_length else list(ids)
            rows.append(ids)
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids, mask


def reward_model_tokenizer(path: str, actor_tokenizer, trust_remote_code: bool = False):
    """The reward model's own tokenizer when it differs from the actor's (vocabulary or chat template),
    else None (the rollout tokens are used as they are). A directory without tokenizer files (a Megatron
    checkpoint) means the actor's."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    same = (
        tok.get_vocab() == actor_tokenizer.get_vocab() and tok.chat_template == actor_tokenizer.chat_template
    )
    if same:
        return None
    if not tok.chat_template:
        raise ValueError(
            f"reward_model.model.path={path}: its tokenizer differs from the actor's but has no chat "
            "template to render the conversation with; add one to its tokenizer_config.json."
        )
    return tok
