"""DAPO's two data-side pieces: dynamic sampling (keep groups whose rewards differ) and overlong
reward shaping.

Dynamic sampling (``algorithm.filter_groups``): a prompt group whose samples all score the same has
zero GRPO advantage everywhere and teaches nothing; the trainer drops such groups and generates more
prompts until the batch is full (``Trainer.rollout_filtered``). ``informative_groups`` decides which
rows stay.

Overlong shaping (``reward_model.overlong_buffer``): with L_max = data.max_response_length and a buffer
of ``len`` tokens, a response of L tokens (EOS included) gets

    penalty = min(-(L - (L_max - len)) / len * penalty_factor, 0)

added to its score: nothing up to L_max - len, then linearly down to -penalty_factor at L_max.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["informative_groups", "overlong_penalty"]


def informative_groups(values: torch.Tensor, uids: Sequence[Hashable]) -> list[bool]:
    """Per row: does its group (rows with the same uid) have a spread of ``values`` [B] (population
    std > 0), or only one sample? Those rows are kept by dynamic sampling."""
    groups: dict[Hashable, list[float]] = {}
    for uid, v in zip(uids, values.tolist(), strict=True):
        groups.setdefault(uid, []).append(v)
    keep = {
        uid: len(vs) == 1 or torch.tensor(vs, dtype=torch.float64).std(correction=0).item() > 0
        for uid, vs in groups.items()
    }
    return [keep[uid] for uid in uids]


def overlong_penalty(
    lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """The overlong penalty (<= 0) of each response, lengths [B] -> [B] float32."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={buffer_len} must be in (0, data.max_response_length="
            f"{max_response_length}]."
        )
    expected = max_response_length - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
