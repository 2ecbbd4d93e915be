"""maj@k on string predictions, as verl's calc_maj_val votes on any hashable "pred": the reward
function's string pred reaches validation and the vote, ties going to the pred drawn first, is worked
out by hand on fixed bootstrap subsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.reward.scoring import ValidationScores, reward_scores
from megatron_rl.reward.source import RewardOutput, RewardSource
from tests.conftest import single_ps

PREDS = ["\\boxed{42}", "\\boxed{7}", "\\boxed{7}", "\\boxed{42}"]
ACC = [1.0, 0.0, 0.0, 1.0]
REWARD = [0.9, 0.2, 0.3, 0.8]
# Fixed subsets (indices of the 4 samples) in place of the 1000 bootstrap draws.
DRAWS = {
    2: np.array([[1, 0], [0, 3], [2, 1], [3, 2]]),
    4: np.array([[0, 1, 2, 3], [1, 2, 3, 0], [3, 3, 1, 2]]),
}


def _batch(preds, acc):
    meta = [
        SeqMeta(uid="p0", data_source="math", reward_extras={"acc": a}, pred=p)
        for p, a in zip(preds, acc, strict=True)
    ]
    ones = torch.ones(len(meta), 1, dtype=torch.long)
    return RolloutBatch.from_tokens(ones, ones, ones, ones, meta)


def _metrics(preds, acc=ACC, reward=REWARD):
    scores = ValidationScores(4)
    scores.draws = {k: v.copy() for k, v in DRAWS.items()}
    batch = _batch(preds, acc)
    scores.add(batch, torch.tensor(reward, dtype=torch.float64), len(batch))
    return scores.metrics(single_ps())


def test_maj_at_k_votes_on_string_preds_by_hand():
    m = _metrics(PREDS)
    # k=2: [1,0] 7 vs 42, a tie: 7 drawn first, its value at sample 1; [0,3] 42 (sample 0);
    # [2,1] 7 (sample 2); [3,2] a tie, 42 drawn first (sample 3)
    assert m["val-aux/math/acc/maj@2/mean"] == pytest.approx(np.mean([0.0, 1.0, 0.0, 1.0]))
    assert m["val-aux/math/acc/maj@2/std"] == pytest.approx(np.std([0.0, 1.0, 0.0, 1.0]))
    assert m["val-aux/math/reward/maj@2/mean"] == pytest.approx(np.mean([0.2, 0.9, 0.3, 0.8]))
    assert m["val-aux/math/reward/maj@2/std"] == pytest.approx(np.std([0.2, 0.9, 0.3, 0.8]))
    # k=4, every subset a 2-2 tie: the pred drawn first wins, at its first draw
    # [0,1,2,3] 42 (sample 0); [1,2,3,0] 7 (sample 1); [3,3,1,2] 42 (sample 3)
    assert m["val-core/math/acc/maj@4/mean"] == pytest.approx(np.mean([1.0, 0.0, 1.0]))
    assert m["val-aux/math/reward/maj@4/mean"] == pytest.approx(np.mean([0.9, 0.2, 0.8]))
    assert m["val-aux/math/reward/maj@4/std"] == pytest.approx(np.std([0.9, 0.2, 0.8]))
    # a string pred is a vote, not a variable (verl skips string values)
    assert not any("/pred/" in k for k in m)


def test_the_same_votes_as_numbers_give_the_same_numbers():
    as_numbers = _metrics([None] * 4)  # no vote without a pred: no maj@k
    assert not any("maj@" in k for k in as_numbers)
    numeric = ValidationScores(4)
    numeric.draws = {k: v.copy() for k, v in DRAWS.items()}
    meta = [
        SeqMeta(uid="p0", data_source="math", reward_extras={"acc": a, "pred": float(p[7:-1])})
        for p, a in zip(PREDS, ACC, strict=True)
    ]
    ones = torch.ones(4, 1, dtype=torch.long)
    numeric.add(RolloutBatch.from_tokens(ones, ones, ones, ones, meta), torch.tensor(REWARD), 4)
    got, strings = numeric.metrics(single_ps()), _metrics(PREDS)
    for k, v in strings.items():
        assert got[k] == pytest.approx(v), k


def test_a_wrong_tie_break_would_differ():
    # ties to the pred drawn last would give k=2: samples 0, 0, 2, 2; k=4: samples 1, 3, 1
    m = _metrics(PREDS)
    assert m["val-aux/math/reward/maj@2/mean"] != pytest.approx(np.mean([0.9, 0.9, 0.3, 0.3]))
    assert m["val-aux/math/reward/maj@4/mean"] != pytest.approx(np.mean([0.2, 0.8, 0.2]))


def test_a_string_pred_flows_from_the_reward_function_into_the_rows():
    from megatron_rl.config import load_config
    from megatron_rl.reward.rules import RewardManager

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": 1.0, "pred": "\\boxed{" + solution_str + "}"}

    manager = RewardManager(None, compute_score, {}, 0, 0.1)
    value, extras = manager._score_one("math", "42", "42", None)
    assert value == 1.0 and extras == {"acc": 1.0, "pred": "\\boxed{42}"}
    out = RewardOutput.from_rows(torch.ones(2), [extras, {"acc": 0.0}], 0)
    assert out.preds == ["\\boxed{42}", None] and sorted(out.extras) == ["acc"]

    class Fixed(RewardSource):
        name = "fixed"

        def score_batch(self, batch, lengths):
            return out

    batch = _batch([None, None], [0.0, 0.0])
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/x"])
    reward_scores(Fixed(), batch, single_ps(), cfg)
    assert [m.pred for m in batch.meta] == ["\\boxed{42}", None]
    assert [m.reward_extras for m in batch.meta] == [{"acc": 1.0}, {"acc": 0.0}]
