"""Micro-batches of one pass: a fixed number of sequences, or a token budget (dynamic batching).

Every pass over this rank's sequences (old and reference log-probs, values, each mini-batch of the actor
and critic updates) is cut into micro-batches; each runs as one forward (and backward) through
:func:`megatron_rl.models.forward.run_pipeline`. Shapes: B sequences, prompts left padded to P, responses
right padded to R.

Fixed size (``use_dynamic_bsz=false``): ``size`` sequences each, in batch order, at the full width
[size, P+R]. The last micro-batch is filled up with copies of row 0 (their outputs are dropped) because
every micro-batch of a fixed pass of padded rows has one shape (packed passes leave it short).

Token budget (``use_dynamic_bsz=true``): the sequences (prompt + response) are sorted longest first and
cut into consecutive groups; a sequence joins the open group while ``rows x its longest sequence`` stays
within ``max_tokens``. Each micro-batch is compacted (:meth:`RolloutBatch.compacted`): every row's real
tokens move to the front and the row is cut to the group's longest sequence, [b, L]; the head reads
each row's response positions by index. A group of similar lengths so carries little padding. The
micro-batch count is made equal over the data-parallel ranks (a rank with fewer splits its largest
groups), so that every DP replica runs the same number of forward/backward steps; the stages of one
pipeline hold the same rows and so make the same plan. Compacting shifts every position of a row by
the same amount (its prompt's left padding), and RoPE depends on position differences only, so
log-probs and values do not change (beyond float rounding). The loss normalisation does not depend
on the split either (ppo.py divides by mini-batch counts).

Packed (``*.megatron.use_remove_padding``, models/packing.py): the forward runs each micro-batch as
one row of its real tokens, so a micro-batch costs the sum of its lengths (rounded up to the TP multiple
under sequence parallelism) instead of rows x its longest; the token budget counts that sum. The groups
are cut, compacted and evened over DP as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config, ConfigError


@dataclass(frozen=True)
class MicroBatching:
    """How one pass cuts its sequences into micro-batches."""

    size: int
    """Sequences per micro-batch (fixed-size path)."""
    max_tokens: int | None = None
    """Token budget per micro-batch (dynamic path; padding included unless packed); None: fixed size."""
    key: str = "max_token_len_per_gpu"
    """The config key that sets ``max_tokens`` (named in errors)."""

    @property
    def dynamic(self) -> bool:
        return self.max_tokens is not None

    @classmethod
    def of(cls, size: int, dynamic: bool | None, max_tokens: int | None, key: str) -> MicroBatching:
        """From a pass's config keys: ``size`` sequences, or ``max_tokens`` (set by ``key``) when
        ``dynamic``."""
        if dynamic and max_tokens is None:
            raise ConfigError(f"use_dynamic_bsz needs {key} (load the config with load_config)")
        return cls(size, max_tokens if dynamic else None, key)


@dataclass
class TokenStats:
    """Tokens processed by the training passes of one step: real ones, and all (padding included)."""

    real: int = 0
    processed: int = 0
    micro_batch_tokens: list[list[int]] = field(default_factory=list)
    """Per pass, the processed tokens of each micro-batch (padding included)."""

    def add_pass(
        self, micro_batches: list[RolloutBatch], real: int, multiple: int, packed: bool = False
    ) -> None:
        sizes = [_cost(mb, multiple, packed) for mb in micro_batches]
        self.micro_batch_tokens.append(sizes)
        self.real += real
        self.processed += sum(sizes)

    def padding_fraction(self, dp_group=None, device=None) -> float:
        """Padded tokens / tokens processed, summed over the data-parallel group."""
        counts = torch.tensor([self.real, self.processed], dtype=torch.float64, device=device)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(counts, group=dp_group)
        real, processed = counts.tolist()
        return 1.0 - real / processed if processed else 0.0


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _cost(mb: RolloutBatch, multiple: int, packed: bool) -> int:
    """Tokens one micro-batch's forward processes: its real ones packed, else rows x its width."""
    if packed:
        return _round_up(int(mb.attention_mask.sum()), multiple)
    return len(mb) * _round_up(mb.input_ids.shape[1], multiple)


def _check_fits(tokens: int, max_tokens: int, key: str) -> None:
    """A sequence is never cut: one longer than the budget is an error naming the budget's key."""
    if tokens > max_tokens:
        raise ConfigError(
            f"a sequence of {tokens} tokens does not fit {key}={max_tokens}: raise {key} to at least "
            f"{tokens}."
        )


def sequence_lengths(batch: RolloutBatch) -> list[int]:
    """Real (prompt + response) tokens of each row, from the attention mask."""
    return batch.attention_mask.bool().sum(1).tolist()


def token_budget_groups(
    lengths: list[int], max_tokens: int, multiple: int = 1, key: str = "", packed: bool = False
) -> list[list[int]]:
    """Row indices of each micro-batch: longest sequences first, each group within ``max_tokens`` as
    rows x round_up(its longest sequence, ``multiple``), or (``packed``) as round_up(the sum of its
    lengths, ``multiple``). A sequence that alone exceeds the budget is an error naming ``key``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order:
        _check_fits(_round_up(lengths[order[0]], multiple), max_tokens, key)
    groups: list[list[int]] = []
    used = 0  # packed: the open group's real tokens
    for i in order:
        if packed:
            fits = bool(groups) and _round_up(used + lengths[i], multiple) <= max_tokens
        else:  # the open group's width is its first (longest) sequence's
            fits = (
                bool(groups)
                and (len(groups[-1]) + 1) * _round_up(lengths[groups[-1][0]], multiple) <= max_tokens
            )
        if fits:
            groups[-1].append(i)
            used += lengths[i]
        else:
            groups.append([i])
            used = lengths[i]
    return groups


def split_to_count(groups: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the groups with the most tokens in two (halves of their length order) until there are
    ``count`` (or every group is one row). Splitting never raises a group's padded size."""
    groups = [list(g) for g in groups]
    while len(groups) < count:

        def padded(k: int) -> tuple[bool, int]:
            return len(groups[k]) > 1, len(groups[k]) * max(lengths[i] for i in groups[k])

        j = max(range(len(groups)), key=padded)
        if len(groups[j]) < 2:
            break
        half = len(groups[j]) // 2
        groups[j : j + 1] = [groups[j][:half], groups[j][half:]]
    return groups


def plan(
    batch: RolloutBatch,
    mb: MicroBatching,
    multiple: int,
    dp_group=None,
    device=None,
    count_multiple: int = 1,
    packed: bool = False,
) -> list[list[int]]:
    """Row indices of each micro-batch of ``batch`` under ``mb`` (see the module docstring). The fixed
    path's last group may be short (the caller fills it up). ``count_multiple``: the dynamic path
    splits groups until their count is a multiple of it (interleaved pipelines: PP). ``packed``: the
    budget counts each group's real tokens."""
    n = len(batch)
    if not mb.dynamic:
        if mb.size <= 0:
            raise ValueError(f"micro-batch size must be > 0, got {mb.size}")
        return [list(range(i, min(i + mb.size, n))) for i in range(0, n, mb.size)]
    lengths = sequence_lengths(batch)
    longest = _round_up(max(lengths), multiple)
    # an over-budget sequence fails on every DP rank together (not one rank, with the others waiting)
    fits = longest <= mb.max_tokens
    groups = token_budget_groups(lengths, mb.max_tokens, multiple, mb.key, packed) if fits else []
    count = len(groups)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        counts = torch.tensor([len(groups), longest], device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=dp_group)
        count, longest = counts.tolist()
    _check_fits(longest, mb.max_tokens, mb.key)
    count = _round_up(count, count_multiple)
    groups = split_to_count(groups, count, lengths)
    if len(groups) != count and count_multiple > 1:  # fewer rows than micro-batches needed
        raise ConfigError(
            f"{len(batch)} sequences cannot make {count} micro-batches, a multiple of "
            f"pipeline_model_parallel_size={count_multiple} as interleaved pipelines need: lower "
            "*.megatron.virtual_pipeline_model_parallel_size to 1 or give each rank more sequences."
        )
    return groups


def micro_batches(
    batch: RolloutBatch,
    mb: MicroBatching,
    multiple: int = 1,
    dp_group=None,
    device=None,
    stats: TokenStats | None = None,
    count_multiple: int = 1,
    packed: bool = False,
) -> tuple[list[RolloutBatch], list[list[int]]]:
    """The micro-batches of ``batch`` and the rows of ``batch`` each holds (fixed path of padded rows:
    the filler rows of the last micro-batch are not listed; packed: it has none). ``multiple``: the
    sequence length the forward pads to (TP under sequence parallelism); ``count_multiple`` and
    ``packed``: see :func:`plan`. ``stats`` counts the tokens of this pass."""
    groups = plan(batch, mb, multiple, dp_group, device, count_multiple, packed)
    if mb.dynamic:
        micro = [batch.select(g).compacted() for g in groups]
    else:
        micro = batch.split(mb.size)  # consecutive rows: views, no copy
        last = groups[-1]
        if len(last) < mb.size and not packed:  # padded rows: one shape for every micro-batch
            micro[-1] = batch.select(last + [0] * (mb.size - len(last)))
    if stats is not None:
        stats.add_pass(micro, int(batch.attention_mask.sum()), multiple, packed)
    return micro, groups


def response_keep(mb: RolloutBatch) -> torch.Tensor:
    """[b, r] float32: 1 where the micro-batch's response position holds a real token (the token after
    each predicting position is attended), 0 on the right padding."""
    if mb.response_index is None:
        return mb.attention_mask[:, -mb.response_length :].float()
    padded = F.pad(mb.attention_mask, (0, 1))  # the last index + 1 may be the width
    return padded.gather(1, mb.response_index + 1).float()


@dataclass(frozen=True)
class ForwardPasses:
    """The micro-batching of the forward-only passes of a step, from their config keys."""

    old_log_prob: MicroBatching
    ref: MicroBatching
    values: MicroBatching

    @classmethod
    def from_config(cls, cfg: Config) -> ForwardPasses:
        rollout, ref, critic = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
        return cls(
            old_log_prob=MicroBatching.of(
                rollout.log_prob_micro_batch_size_per_gpu,
                rollout.log_prob_use_dynamic_bsz,
                rollout.log_prob_max_token_len_per_gpu,
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            ),
            ref=MicroBatching.of(
                ref.log_prob_micro_batch_size_per_gpu,
                ref.log_prob_use_dynamic_bsz,
                ref.log_prob_max_token_len_per_gpu,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ),
            values=MicroBatching.of(
                critic.ppo_micro_batch_size_per_gpu,
                critic.use_dynamic_bsz,
                critic.forward_max_token_len_per_gpu,
                "critic.forward_max_token_len_per_gpu",
            ),
        )
