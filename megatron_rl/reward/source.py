"""The one protocol every reward source implements; scoring.reward_scores talks to nothing else.

    class MyReward(RewardSource):
        name = "..."                          shown in error lines
        collective = False                    True: every rank of a model replica calls score_batch (a
                                              model forward, collective over TP/PP); False: the
                                              replica's first rank calls it, scoring broadcasts the result
        needs_prompts = False                 True: the source reads the prompt text too
        def score_batch(self, batch, response_lengths) -> RewardOutput

The sources: rules.RewardManager (the built-in rules and custom_reward_function), http.HttpRewardManager
(reward_model.http.url), model.ModelReward (reward_model.enable); scoring.make_reward_fn picks one. A
new source subclasses RewardSource and gets a branch in make_reward_fn.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from megatron_rl.batch import RolloutBatch


@dataclass
class RewardOutput:
    """What a batch of rewards gives back."""

    scores: torch.Tensor
    """[B] float32 sequence scores (0.0 where the reward function failed)."""
    extras: dict[str, torch.Tensor]
    """Other numeric keys of dict-returning reward functions, [B] float32 each, NaN where a sample did
    not return the key."""
    num_errors: int
    """Samples whose reward function raised or returned a non-number."""
    preds: list[Hashable | None] | None = None
    """Per sample, a "pred" that is not a number (a string answer such as "\\boxed{42}"): what verl's
    majority vote (maj@k) counts; None where a sample returned none or a numeric one (that is an extra)."""

    @classmethod
    def from_rows(cls, scores: torch.Tensor, rows: list[dict[str, Any]], num_errors: int) -> RewardOutput:
        """Per-sample extra keys (one dict per sample) -> one [B] column per key, NaN where absent; a
        "pred" that is not a number goes to ``preds``."""
        extras: dict[str, torch.Tensor] = {}
        preds: list[Hashable | None] | None = None
        for i, row in enumerate(rows):
            for k, v in row.items():
                if k == "pred" and not isinstance(v, numbers.Real):
                    preds = preds or [None] * len(rows)
                    preds[i] = v
                    continue
                extras.setdefault(k, torch.full((len(rows),), math.nan))[i] = v
        return cls(scores, extras, num_errors, preds)


class RewardSource(ABC):
    """Scores of a rollout batch (module docstring)."""

    collective: ClassVar[bool] = False
    """Every rank of a model replica calls :meth:`score_batch` (else only its first rank does)."""
    needs_prompts: ClassVar[bool] = False
    """The source reads each sample's prompt as well as its response."""

    @property
    @abstractmethod
    def name(self) -> str: ...

    @abstractmethod
    def score_batch(self, batch: RolloutBatch, response_lengths: torch.Tensor) -> RewardOutput:
        """Scores [B] float32 (CPU), extra keys [B] each, error count, for the batch's rows;
        ``response_lengths`` [B]: each response's generated tokens (tool tokens included)."""


def response_token_lists(batch: RolloutBatch, response_lengths: torch.Tensor) -> list[list[int]]:
    """Each row's generated token ids (what rule and server rewards decode)."""
    responses = batch.responses.cpu()
    return [responses[i, :n].tolist() for i, n in enumerate(response_lengths.tolist())]
