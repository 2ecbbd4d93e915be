"""A DeepSeek-V3 actor (multi-latent attention, sigmoid routing) at EP=2 resumes bit for bit: four steps
in one run equal 2 + 2 steps resumed from a checkpoint, the expert-score biases included (they move with
the experts' load at every optimizer step, outside the optimizer: the checkpoint must carry them)."""

import pytest
import torch

from megatron_rl.demo import prepare
from tests.distributed.test_trainer import metrics, stable, torch_dist_tensors


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")), moe=True, moe_arch="deepseek_v3")


def overrides(demo, out_dir, steps: int) -> list[str]:
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
        "actor_rollout_ref.model.path": demo["model_deepseek_v3"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "critic.ppo_micro_batch_size_per_gpu": 8,
        "trainer.default_local_dir": out_dir,
        "trainer.logger": "[console,jsonl]",
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "auto",
        "trainer.total_training_steps": steps,
    }
    return ["--config", "yaml/cpu_demo_moe.yaml", *(f"{k}={v}" for k, v in kw.items())]


def test_deepseek_v3_resume_is_bit_exact_with_its_expert_biases(demo, tmp_path, torchrun):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    torchrun("train.py", 2, overrides(demo, straight, 4))
    torchrun("train.py", 2, overrides(demo, split, 2))
    torchrun("train.py", 2, overrides(demo, split, 4))
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
    first = torch_dist_tensors(f"{split}/global_step_2/actor")
    wa, wb = (torch_dist_tensors(f"{d}/global_step_4/actor") for d in (straight, split))
    biases = [k for k in wa if k.endswith("router.expert_bias")]
    assert biases, sorted(wa)[:8]
    # They start at zero and move by +-rate each step: nonzero at a checkpoint means they moved (step 2
    # and step 4 may hold the same values when the load swings back between them).
    assert any(first[k].count_nonzero() or wa[k].count_nonzero() for k in biases), (
        "the expert biases never moved"
    )
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"actor.{k} differs"
