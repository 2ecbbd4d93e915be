"""The rollout-training mismatch on a batch (algorithm.rollout_correction), between the old log-probs and the
update: the formulas are in algos/rollout_corr.py.

    correct_mismatch(batch)   mismatch metrics of batch.rollout_log_probs against batch.old_log_probs,
                              and (rollout_is) the truncated importance weights -> batch.rollout_is_weights
                              rollout_corr/missing_log_probs: the share of response tokens the engine
                              gave no log-prob for (NaN); those take the trainer's (ratio 1), so a share
                              above 0 means the correction did not see part of the batch
    reject(batch)             (rollout_rs, after the advantages) rejected tokens or sequences leave the
                              response mask and their advantages are zeroed; group statistics were taken
                              before, over every sample
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_rl.algos import rollout_corr
from megatron_rl.batch import RolloutBatch
from megatron_rl.config import RolloutCorrectionConfig

log = logging.getLogger(__name__)
_warned_missing = False  # the missing log-prob warning is logged once per process


def correct_mismatch(batch: RolloutBatch, corr: RolloutCorrectionConfig, group) -> dict[str, float]:
    """See the module docstring; ``group`` is the data-parallel group the statistics cover."""
    global _warned_missing
    mask = batch.response_mask
    # Counted under the response mask only: tool/user tokens of multi-turn episodes have none by design.
    n_missing, n_tokens = rollout_corr.missing_log_probs(batch.rollout_log_probs, mask, group)
    # Where the engine gave no log-prob, its value is taken to be the trainer's (ratio 1).
    rollout_lp = torch.where(batch.rollout_log_probs.isnan(), batch.old_log_probs, batch.rollout_log_probs)
    batch.rollout_log_probs = rollout_lp
    metrics = rollout_corr.mismatch_metrics(batch.old_log_probs, rollout_lp, mask, group)
    metrics["rollout_corr/missing_log_probs"] = n_missing / max(n_tokens, 1.0)
    if n_missing > 0 and not _warned_missing and (not dist.is_initialized() or dist.get_rank() == 0):
        _warned_missing = True
        log.warning(
            "the rollout engine gave no log-prob for %d of %d response tokens (%.2f%%): their importance "
            "ratio is taken as 1 (rollout_corr/missing_log_probs tracks it; logged once)",
            int(n_missing),
            int(n_tokens),
            100 * n_missing / max(n_tokens, 1.0),
        )
    if corr.rollout_is is not None:
        batch.rollout_is_weights, is_metrics = rollout_corr.importance_weights(
            batch.old_log_probs,
            rollout_lp,
            mask,
            corr.rollout_is,
            corr.rollout_is_threshold,
            corr.rollout_is_batch_normalize,
            group,
        )
        metrics.update(is_metrics)
    return metrics


def reject(batch: RolloutBatch, options: list[tuple[str, float, float]], group) -> dict[str, float]:
    """See the module docstring; ``options`` from rollout_corr.parse_rs."""
    keep, metrics = rollout_corr.rejection_mask(
        batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, options, group
    )
    batch.response_mask = keep
    batch.advantages = batch.advantages * keep
    return metrics
