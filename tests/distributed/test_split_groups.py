"""verl's batch rule in samples on two data-parallel ranks: data.train_batch_size odd, x rollout.n even,
so one prompt's samples lie on both ranks. A real run trains a step and its advantages are those one
process computes on the whole batch; DAPO's refill keeps whole groups over the ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.algos.advantages import compute_grpo_outcome_advantage
from megatron_rl.demo import prepare
from tests.conftest import run_forked_ranks, run_torchrun

SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(ord(c) for c in solution_str) % 7)
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


def test_an_odd_prompt_batch_trains_on_two_ranks_with_the_one_process_advantages(demo, tmp_path, monkeypatch):
    reward = tmp_path / "score.py"
    reward.write_text(SCORE)
    out = str(tmp_path / "run")
    os.makedirs(out)
    monkeypatch.setenv("SPLIT_GROUPS_OUT", out)
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.val_batch_size": 8,
        "actor_rollout_ref.model.path": demo["model"],
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "algorithm.adv_estimator": "grpo",
        # 3 prompts x 2 samples = 6 samples, 3 per rank: prompt 1's samples on ranks 0 and 1
        "data.train_batch_size": 3,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 3,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 3,
        "custom_reward_function.path": str(reward),
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": False,
        "trainer.save_freq": -1,
        "trainer.save_at_end": False,
        "trainer.default_local_dir": out,
        "trainer.logger": "[console,jsonl]",
    }
    run_torchrun(
        "split_groups.py", 2, ["--config", "yaml/cpu_demo.yaml", *(f"{k}={v}" for k, v in kw.items())]
    )
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert "actor/pg_loss" in rows[-1] and "val-core/toy/copy_last_digit/reward/mean@1" in rows[-1]
    ranks = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.jsonl")) as f:
            ranks.append([json.loads(line) for line in f])
    spread = 0
    for step in range(2):
        parts = [ranks[r][step] for r in range(2)]
        assert [len(p["uids"]) for p in parts] == [3, 3]
        uids = parts[0]["uids"] + parts[1]["uids"]
        assert sorted(uids.count(u) for u in set(uids)) == [2, 2, 2]  # 3 groups of n=2
        spread += len(set(parts[0]["uids"]) & set(parts[1]["uids"]))
        # the one-process oracle: GRPO on the concatenated batch, no process group
        scores = torch.tensor(parts[0]["scores"] + parts[1]["scores"], dtype=torch.float32)
        rewards, mask = torch.zeros(6, 1), torch.ones(6, 1)
        rewards[:, 0] = scores
        want, _ = compute_grpo_outcome_advantage(rewards, mask, uids)
        got = torch.tensor(parts[0]["advantages"] + parts[1]["advantages"])
        torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-5)
    assert spread == 2  # every step, one prompt's two samples on the two ranks


# ---------------------------------------------------------------- DAPO's refill, groups over ranks

N, B, ROWS = 2, 3, 12
# the score of sample s of prompt p: prompts 0, 4, 8 score alike (dropped), the others differ
TABLE = {p: ([1.0, 1.0] if p % 4 == 0 else [float(p), float(p) + 1.0]) for p in range(ROWS)}


def _ps(rank: int):
    from megatron_rl.parallel import ParallelState

    world = dist.group.WORLD
    return ParallelState(
        rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo",
        tp_size=1, pp_size=1, dp_size=2, tp_rank=0, pp_rank=0, dp_rank=rank,
        tp_group=None, pp_group=None, dp_group=world, mp_group=None, embedding_group=None,
    )  # fmt: skip


def _refill_rank(rank: int, init_file: str, out_dir: str) -> None:
    from megatron_rl.batch import RolloutBatch, SeqMeta
    from megatron_rl.config import load_config
    from megatron_rl.data import ResumableDistributedSampler
    from megatron_rl.reward.refill import scored_batch
    from megatron_rl.reward.source import RewardOutput, RewardSource
    from megatron_rl.run.metrics import Timer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ps = _ps(rank)
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/models/x",
            f"data.train_batch_size={B}",
            f"actor_rollout_ref.rollout.n={N}",
            "algorithm.adv_estimator=grpo",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=score",
        ],
    )
    sampler = ResumableDistributedSampler(ROWS, B, rank, 2, seed=0, shuffle=False, group_size=N)
    draws = iter(sampler)

    def generate(indices):  # rank r holds samples 3r..3r+2 of the round: their place in the group
        k = len(indices)
        meta = [
            SeqMeta(uid=f"1-{p}", extra_info={"p": p, "s": (rank * k + i) % N}) for i, p in enumerate(indices)
        ]
        prompts, ones = torch.full((k, 2), 5), torch.ones(k, 2)
        return RolloutBatch.from_tokens(prompts, ones, torch.full((k, 1), 7), torch.ones(k, 1), meta)

    class Table(RewardSource):
        name = "table"

        def score_batch(self, batch, lengths):
            s = [TABLE[m.extra_info["p"]][m.extra_info["s"]] for m in batch.meta]
            return RewardOutput(torch.tensor(s), {}, 0)

    metrics: dict[str, float] = {}
    batch = scored_batch(
        generate, next(draws), lambda: next(draws), Table(), ps, cfg, 0, Timer(ps.device), metrics
    )
    adv, _ = compute_grpo_outcome_advantage(
        batch.token_level_scores, batch.response_mask, [m.uid for m in batch.meta], group=ps.dp_group
    )
    rows = [(m.extra_info["p"], m.extra_info["s"], m.uid) for m in batch.meta]
    result = {"rows": rows, "scores": batch.token_level_scores.sum(-1).tolist(), "adv": adv[:, 0].tolist()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({**result, "metrics": metrics}, f)
    dist.destroy_process_group()


def test_dapo_keeps_whole_groups_of_the_whole_batch_and_deals_them_evenly(tmp_path):
    run_forked_ranks(_refill_rank, tmp_path)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    rows = [tuple(x[:2]) for r in ranks for x in r["rows"]]
    # rounds of prompts [0, 1, 2], [3, 4, 5], ...: 0 and 4 score alike -> the first 3 kept are 1, 2, 3,
    # each with both its samples, in order, 3 rows on each rank (prompt 2 spans the ranks)
    assert rows == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [len(r["rows"]) for r in ranks] == [3, 3]
    m = ranks[0]["metrics"]
    # two rounds of 3 prompts generated; 0 and 4 dropped (5 informative but past the batch)
    assert m["train/num_gen_batches"] == 2 and m["train/num_dropped_groups"] == 2
    assert m["train/dropped_group_ratio"] == pytest.approx(1 / 3)
    assert ranks[1]["metrics"] == m
    # GRPO over the ranks equals one process's on the whole batch: each group [p, p + 1] -> [-0.707, 0.707]
    uids = [x[2] for r in ranks for x in r["rows"]]
    assert len(set(uids)) == 3
    scores = torch.tensor([s for r in ranks for s in r["scores"]])
    rewards = scores[:, None]
    want, _ = compute_grpo_outcome_advantage(rewards, torch.ones_like(rewards), uids)
    torch.testing.assert_close(torch.tensor([a for r in ranks for a in r["adv"]]), want[:, 0])
    assert want[0, 0] < 0 < want[1, 0]
