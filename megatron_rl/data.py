"""Prompt data: verl-format parquet -> tokenized prompts -> per-rank batches -> left-padded tensors.

Row format (identical to verl's, so datasets preprocessed for verl load unchanged). One parquet row is
one prompt:

    prompt        list[{"role": str, "content": str}]  chat messages, rendered with the tokenizer's chat
                                                        template plus the generation prompt
    data_source   str                                   selects the reward function, e.g. "openai/gsm8k"
    reward_model  {"style": "rule", "ground_truth": str} ground_truth is handed to the reward function
    extra_info    dict, optional                        e.g. {"split": "train", "index": 7}; handed to the
                                                        reward function as is
    ability       str, optional                         e.g. "math"; not used by training

Data flow:

    PromptDataset(files, tokenizer, max_prompt_length)
        reads every file with pyarrow, renders and tokenizes all prompts up front (so an overlong or
        malformed row fails at start-up, not hours into a run), then drops or truncates overlong prompts
    ResumableDistributedSampler(len(dataset), train_batch_size, dp_rank, dp_size, seed, group_size=n)
        yields, per step, this data-parallel rank's slice of the global batch of row positions (whole
        prompts, or one entry per sample when the prompts do not divide over the ranks);
        state_dict()/load_state_dict() resume mid-epoch at the exact next batch
    collate_left_pad([dataset[i] for i in indices], pad_token_id)
        -> input_ids [B, P], attention_mask [B, P], left padded so generation appends on the right
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megatron_rl import seeds
from megatron_rl.config import DataError

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")

_FORMAT_HINT = (
    "verl's format expects columns 'prompt' (list of {'role', 'content'} chat messages), "
    "'data_source' (str), 'reward_model' ({'style': 'rule', 'ground_truth': str}) "
    "and optionally 'extra_info' (dict) and 'ability' (str)"
)


@dataclass
class PromptItem:
    """One tokenized prompt and what its reward function needs."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    """Row position in the concatenation of the input files, counted before overlong rows are dropped."""
    messages: Any = None
    """The prompt as the file holds it (a chat message list): a reward model with its own chat template
    re-renders it."""


def _as_file_list(files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    return [os.path.expanduser(os.fspath(f)) for f in files]  # "~/data/x.parquet" as in a shell


def check_files(files: Sequence[str], prompt_key: str) -> None:
    """Each file exists, is parquet, has the columns a prompt file needs and a ground truth in every
    row (no tokenizing): the dry run's check of data.train_files / data.val_files. Raises
    :class:`DataError`."""
    for path in _as_file_list(files):
        for i, row in enumerate(_read_rows(path, prompt_key)):
            _check_ground_truth(row, path, i)


def _check_ground_truth(row: dict[str, Any], source: str, i: int) -> None:
    """A row's reward_model must carry the ground truth the reward compares against."""
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataError(
            f"{source}: row {i} has reward_model={reward_model!r} without a 'ground_truth'. {_FORMAT_HINT}"
        )


def _read_rows(path: str, prompt_key: str) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        raise DataError(f"data file {path!r} does not exist (check data.train_files / data.val_files)")
    try:
        table: pa.Table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data file {path!r} is not a readable parquet file ({first})") from None
    for column in (prompt_key, "data_source", "reward_model"):
        if column not in table.column_names:
            raise DataError(
                f"{path}: missing column {column!r} (found {table.column_names}). {_FORMAT_HINT}. "
                "If the prompt column has another name, set data.prompt_key."
            )
    wanted = [c for c in (prompt_key, "data_source", "reward_model", "extra_info") if c in table.column_names]
    return table.select(wanted).to_pylist()


class PromptDataset(torch.utils.data.Dataset):
    """Tokenized prompts from one or more verl-format parquet files (see the module docstring).

    ``filter_overlong_prompts=True`` drops prompts longer than ``max_prompt_length`` tokens (counted in
    ``num_filtered``, row positions in ``filtered_indices``). Otherwise ``truncation`` decides:
    "error" raises, "left" keeps the last tokens, "right" the first, "middle" both ends.
    """

    def __init__(
        self,
        files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        prompt_key: str = "prompt",
        rule_sources: Collection[str] | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        """``rule_sources``: when rewards come from the built-in rules, the data_source values they know;
        a row with another data_source, or with a null ground truth, is then a DataError naming it.
        ``tools``: OpenAI function schemas handed to the chat template (multi-turn tool calling)."""
        self.tools = tools or None
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        self.files = _as_file_list(files)
        if not self.files:
            raise ValueError("PromptDataset needs at least one parquet file")
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.prompt_key = prompt_key

        rows: list[dict[str, Any]] = []
        sources: list[str] = []
        for path in self.files:
            file_rows = _read_rows(path, prompt_key)
            if rule_sources is not None:
                _check_rule_rows(path, file_rows, rule_sources)
            rows.extend(file_rows)
            sources.extend([path] * len(file_rows))

        texts = [self._render(tokenizer, row[prompt_key], i, sources[i]) for i, row in enumerate(rows)]
        # The chat template already wrote any BOS/system markup; letting encode add specials would
        # duplicate them.
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        self._items: list[PromptItem] = []
        self.filtered_indices: list[int] = []
        for i, (row, ids) in enumerate(zip(rows, encoded, strict=True)):
            ids = list(ids)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.filtered_indices.append(i)
                    continue
                ids = self._truncate(ids, i, sources[i])
            _check_ground_truth(row, sources[i], i)
            reward_model = row["reward_model"]
            self._items.append(
                PromptItem(
                    prompt_ids=ids,
                    data_source=row["data_source"],
                    ground_truth=reward_model["ground_truth"],
                    extra_info=_clean_extra_info(row.get("extra_info")),
                    index=i,
                    messages=row[prompt_key],
                )
            )
        self.num_rows_read = len(rows)
        if not self._items:
            reason = (
                f"all {len(rows)} prompts are longer than data.max_prompt_length={max_prompt_length}"
                if rows
                else "the files have no rows"
            )
            raise DataError(f"no prompts left in {self.files}: {reason}")
        if self.filtered_indices:
            logger.warning(
                "Filtered %d of %d prompts longer than data.max_prompt_length=%d tokens from %s "
                "(set data.filter_overlong_prompts=false to truncate them instead)",
                len(self.filtered_indices),
                len(rows),
                max_prompt_length,
                self.files,
            )

    @property
    def num_filtered(self) -> int:
        return len(self.filtered_indices)

    def __len__(self) -> int:
        return len(self._items)

    def fingerprint(self) -> str:
        """A digest of the prompts (token ids), data sources and ground truths, in order: a checkpoint
        records it, so that resuming on different data fails instead of silently skipping prompts."""
        h = hashlib.sha1()
        for it in self._items:
            h.update(repr((it.prompt_ids, it.data_source, it.ground_truth)).encode())
        return h.hexdigest()[:16]

    def __getitem__(self, idx: int) -> PromptItem:
        return self._items[idx]

    def _render(self, tokenizer: Any, messages: Any, row: int, path: str) -> str:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DataError(
                f"{path}: row {row} column {self.prompt_key!r} is {messages!r}, expected a list of "
                f"{{'role', 'content'}} chat messages. {_FORMAT_HINT}"
            )
        kw = {"tools": self.tools} if self.tools else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)

    def _truncate(self, ids: list[int], row: int, path: str) -> list[int]:
        limit = self.max_prompt_length
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        if self.truncation == "middle":
            head = limit // 2
            return ids[:head] + ids[len(ids) - (limit - head) :]
        raise DataError(
            f"{path}: prompt at row {row} has {len(ids)} tokens, more than data.max_prompt_length={limit}. "
            "Raise data.max_prompt_length, set data.truncation to 'left', 'right' or 'middle', "
            "or set data.filter_overlong_prompts=true to drop such prompts."
        )


def _check_rule_rows(path: str, rows: list[dict[str, Any]], rule_sources: Collection[str]) -> None:
    """Every row can be scored by a built-in rule: a known data_source and a ground truth."""
    for r, row in enumerate(rows):
        source = row.get("data_source")
        if source not in rule_sources:
            raise DataError(
                f"{path}: row {r} has data_source={source!r}, which no built-in reward rule scores "
                f"(built in: {sorted(rule_sources)}); write compute_score(data_source, solution_str, "
                "ground_truth, extra_info) in a .py file and set custom_reward_function.path to it."
            )
        reward_model = row.get("reward_model")
        if (
            isinstance(reward_model, dict)
            and "ground_truth" in reward_model
            and reward_model["ground_truth"] is None
        ):
            raise DataError(
                f"{path}: row {r} (data_source={source!r}) has reward_model.ground_truth = null, so it could "
                "only ever score 0; fill in the ground truth or drop the row."
            )


def _clean_extra_info(extra_info: Any) -> dict[str, Any]:
    if extra_info is None:
        return {}
    if not isinstance(extra_info, dict):
        return {"value": extra_info}
    # Parquet stores a struct column with the union of all rows' keys; keys a row never had come back
    # as None, and dropping them hands reward functions the dict each row was written with.
    return {k: v for k, v in extra_info.items() if v is not None}


class ResumableDistributedSampler:
    """Per-step index batches for one data-parallel rank, resumable mid-epoch.

    Each step has a global batch of ``batch_size`` row positions, taken in order from a permutation of
    ``range(num_rows)`` that depends only on (seed, epoch). Each prompt stands for ``group_size`` samples
    (rollout.n), sample j of the step being one of prompt j // group_size; the batch_size x group_size
    samples are cut into ``dp_size`` equal contiguous slices, rank r taking the r-th (verl's rule: the
    samples, not the prompts, must divide). When the prompts divide too, rank r's slice is the whole
    prompts ``batch_size // dp_size`` positions from r x that, and a step yields those positions (each
    generates group_size samples: ``per_draw == group_size``); otherwise a step yields one position per
    sample of the slice, a prompt repeated for each of its samples there (``per_draw == 1``), so the
    samples of one prompt may span ranks (with 8 ranks, batch_size 4 and group_size 8: rank 0 holds 4
    of prompt 0's samples, rank 1 the other 4).

    ``iter(sampler)`` is an endless stream of steps that crosses epoch boundaries, so a trainer can call
    ``next()`` once per step for any number of steps; ``iter_epoch()`` yields only the rest of the current
    epoch. Either way ``state_dict()`` taken after consuming k batches of an epoch records
    (epoch, position=k), and a fresh sampler that loads it continues with exactly the batches the
    original had not yet yielded.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        group_size: int = 1,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if batch_size < 1 or group_size < 1 or (batch_size * group_size) % dp_size != 0:
            raise ValueError(
                f"data.train_batch_size x actor_rollout_ref.rollout.n = {batch_size} x {group_size} samples "
                f"must be a positive multiple of the data-parallel size {dp_size}, so every rank gets the "
                "same number of samples"
            )
        if num_rows < 1 or (drop_last and num_rows < batch_size):
            raise ValueError(
                f"the dataset has {num_rows} prompts, fewer than one batch of {batch_size} "
                "(data.train_batch_size); lower the batch size or add data"
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.group_size = group_size
        self.per_draw = group_size if batch_size % dp_size == 0 else 1
        """Samples each yielded position stands for: group_size (whole prompts) or 1 (one per sample)."""
        self.per_rank = batch_size * group_size // (dp_size * self.per_draw)
        """Positions a rank gets per step."""
        self.epoch = 0
        self.position = 0

    def rank_slice(self, batch: list[int]) -> list[int]:
        """This rank's positions of a global batch (class docstring)."""
        start, k, n = self.dp_rank * self.per_rank, self.per_draw, self.group_size
        return [batch[(start + e) * k // n] for e in range(self.per_rank)]

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return (self.num_rows + self.batch_size - 1) // self.batch_size

    @property
    def drawn_epoch(self) -> int:
        """The epoch of the newest batch drawn (0 before any): what a run's ``training/epoch`` reports,
        refills of the group filter included (the sampler is the one count of what was drawn)."""
        return self.epoch if self.position > 0 else max(self.epoch - 1, 0)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self.epoch = epoch
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(seeds.derive(seeds.DATA_ORDER, self.seed, epoch))
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """All ranks' row positions for ``step`` of ``epoch``."""
        return self._slice(self._order(epoch), step)

    def _slice(self, order: list[int], step: int) -> list[int]:
        batch = order[step * self.batch_size : (step + 1) * self.batch_size]
        while len(batch) < self.batch_size:
            # Only with drop_last=False: complete the last batch from the epoch's start (repeatedly, if
            # the batch is larger than the data) so that every rank still gets per_rank prompts.
            batch += order[: self.batch_size - len(batch)]
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.iter_epoch()

    def iter_epoch(self) -> Iterator[list[int]]:
        """This rank's batches for the rest of the current epoch; afterwards the sampler is at the next."""
        self._normalize()
        epoch = self.epoch
        order = self._order(epoch)
        steps = len(self)
        while self.epoch == epoch and self.position < steps:
            step = self.position
            batch = self._slice(order, step)
            # Advanced before yielding: a checkpoint taken while the caller works on this batch must
            # not replay it.
            self.position = step + 1
            yield self.rank_slice(batch)
        self._normalize()

    def _normalize(self) -> None:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, int]:
        epoch, position = self.epoch, self.position
        if position >= len(self):
            epoch, position = epoch + 1, 0
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        # A changed dataset or batch size would silently resume on different prompts.
        for key in ("seed", "num_rows", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler checkpoint has {key}={state[key]} but this run has {key}={getattr(self, key)}; "
                    "resuming would not continue the same data order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def regroup_samples(prompts: list[int], gens: list[list], per_draw: int) -> tuple[list[int], list[list]]:
    """A step's queued prompts (in DP order) and each one's generations, regrouped so that each entry
    holds ``per_draw`` samples: rollout.n (whole prompts) or 1 (one per sample), whichever a rank of the
    current layout draws (ResumableDistributedSampler.per_draw); the samples keep their order."""
    if all(len(g) == per_draw for g in gens):
        return list(prompts), list(gens)
    flat = [(p, s) for p, g in zip(prompts, gens, strict=True) for s in g]
    entries = [flat[i : i + per_draw] for i in range(0, len(flat), per_draw)]
    return [e[0][0] for e in entries], [[s for _, s in e] for e in entries]


def collate_left_pad(
    items: Sequence[PromptItem | Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts to the longest one: (input_ids [B, P] int64, attention_mask [B, P] int64)."""
    seqs = [list(it.prompt_ids) if isinstance(it, PromptItem) else list(it) for it in items]
    if not seqs:
        raise ValueError("collate_left_pad got an empty batch")
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, width - len(seq) :] = 1
    return input_ids, attention_mask
