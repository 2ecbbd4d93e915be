"""Missing engine log-probs are counted (rollout_corr/missing_log_probs) and warned about once."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megatron_rl import mismatch
from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import RolloutCorrectionConfig

NAN = math.nan


def _batch(rollout_lp: list[list[float]], response_mask: list[list[float]]) -> RolloutBatch:
    b, t = len(rollout_lp), len(rollout_lp[0])
    batch = RolloutBatch.from_tokens(
        torch.ones(b, 2, dtype=torch.long),
        torch.ones(b, 2, dtype=torch.long),
        torch.ones(b, t, dtype=torch.long),
        torch.tensor(response_mask),
        [SeqMeta(f"u{i}") for i in range(b)],
    )
    batch.old_log_probs = torch.full((b, t), -1.0)
    batch.rollout_log_probs = torch.tensor(rollout_lp)
    return batch


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(mismatch, "_warned_missing", False, raising=False)


def test_missing_log_probs_is_the_masked_nan_share(caplog):
    # row 0: a NaN on a response token (counted) and on a tool token, mask 0 (not counted);
    # row 1: the last response token has none (counted), the padding after it is NaN too (not counted)
    batch = _batch(
        [[-1.1, NAN, -0.9, NAN], [-1.2, -1.0, NAN, NAN]],
        [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]],
    )
    with caplog.at_level(logging.WARNING, logger="megatron_rl.mismatch"):
        metrics = mismatch.correct_mismatch(batch, RolloutCorrectionConfig(rollout_is="token"), None)
    assert metrics["rollout_corr/missing_log_probs"] == pytest.approx(2 / 6)
    # a missing log-prob still takes the trainer's value: weight 1 there
    assert batch.rollout_log_probs[0, 1].item() == -1.0
    assert batch.rollout_is_weights[1, 2].item() == pytest.approx(1.0)
    warnings = [r for r in caplog.records if "no log-prob" in r.getMessage()]
    assert len(warnings) == 1 and "2 of 6" in warnings[0].getMessage()

    caplog.clear()
    again = _batch([[NAN, -1.0]], [[1.0, 1.0]])
    with caplog.at_level(logging.WARNING, logger="megatron_rl.mismatch"):
        metrics = mismatch.correct_mismatch(again, RolloutCorrectionConfig(), None)
    assert metrics["rollout_corr/missing_log_probs"] == pytest.approx(0.5)
    assert not [r for r in caplog.records if "no log-prob" in r.getMessage()]  # once per process


def test_no_missing_log_probs_no_warning(caplog):
    batch = _batch([[-1.1, -0.9, NAN]], [[1.0, 1.0, 0.0]])
    with caplog.at_level(logging.WARNING, logger="megatron_rl.mismatch"):
        metrics = mismatch.correct_mismatch(batch, RolloutCorrectionConfig(), None)
    assert metrics["rollout_corr/missing_log_probs"] == 0.0
    assert not caplog.records
