"""Multi-turn rollouts in the PPO loop (torchrun, TP=2 over two gloo ranks): the tool demo's episodes
run through the trainer, and the engine's log-probs of the model's tokens equal the Megatron actor's
on the assembled sequences (tool tokens in between); also with the rollout on a rank of its own."""

import json
import os

import pytest

from megatron_rl.demo.tools_task import prepare


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("tools_demo")))


def run_demo(demo, out: str, torchrun, nproc: int = 2, **extra) -> list[dict]:
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
        "data.val_batch_size": 64,
        "actor_rollout_ref.model.path": demo["model"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16,
        "critic.ppo_micro_batch_size_per_gpu": 16,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": demo["tool_config"],
        "actor_rollout_ref.rollout.calculate_log_probs": "true",
        "actor_rollout_ref.rollout.n": 4,  # the demo's 8 samples would double the sizes
        "trainer.default_local_dir": out,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "false",
        **extra,
    }
    args = ["--config", "yaml/cpu_demo_tools.yaml", *(f"{k}={v}" for k, v in kw.items())]
    torchrun("train.py", nproc, args)
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_tool_episodes_train_and_match_the_actor(demo, tmp_path, torchrun, placement):
    # separate: the actor (TP=2) on ranks 0-1, the engine, its agent loop and the tools on rank 2
    own = {"trainer.placement.rollout": "[2]"} if placement == "separate" else {}
    rows = run_demo(demo, str(tmp_path / "run"), torchrun, 3 if own else 2, **own)
    assert [r["step"] for r in rows] == [1, 2]
    assert ("perf/rollout_engine_busy_s" in rows[-1]) == bool(own)  # the engine's rank was its own
    for r in rows:
        assert (
            2
            <= r["multi_turn/num_turns/min"]
            <= r["multi_turn/num_turns/mean"]
            <= r["multi_turn/num_turns/max"]
            <= 4
        )
        for k in ("tool_calls", "tool_errors", "tool_timeouts"):
            assert f"multi_turn/{k}_per_episode" in r
        assert 0 <= r["multi_turn/length_ended_ratio"] <= 1
        # the engine (transformers, fp32) and the TP=2 actor agree on every model token: the sequences
        # the actor scores are the ones the engine generated, tool replies included
        assert r["training/rollout_probs_diff_max"] < 1e-3
    assert sum(r["multi_turn/tool_calls_per_episode"] for r in rows) > 0
    assert rows[-1]["multi_turn/tool_errors_per_episode"] == 0
    assert "val-core/toy/tool_lookup/acc/mean@1" in rows[-1]
