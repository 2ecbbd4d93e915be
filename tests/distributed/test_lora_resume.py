"""LoRA through the whole loop (CPU, two gloo ranks): the actor and the critic with adapters, the KL loss
against the reference (the actor without its adapters: no reference weights are built), on the dense
demo (TP=2) and the MoE demo (EP=2, adapters on every routed expert). Four steps in one run equal 2 + 2
steps resumed from a checkpoint, bit for bit; the checkpoints hold the adapters (and the critic's value
head), never the base weights, and the adapters move."""

import pytest
import torch

from megatron_rl.demo import prepare
from tests.distributed.test_trainer import metrics, stable, torch_dist_tensors


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")), moe=True)


CONFIGS = {"dense": ("yaml/cpu_demo.yaml", "model"), "moe": ("yaml/cpu_demo_moe.yaml", "model_moe")}


def overrides(demo, out_dir, steps: int, kind: str) -> list[str]:
    config, model = CONFIGS[kind]
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
        "actor_rollout_ref.rollout.n": 4,  # the tests' size, whatever the demo's
        "actor_rollout_ref.model.path": demo[model],
        "actor_rollout_ref.model.lora.rank": 4,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "critic.model.lora.rank": 4,
        "critic.ppo_micro_batch_size_per_gpu": 8,
        "trainer.default_local_dir": out_dir,
        "trainer.logger": "[console,jsonl]",
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "auto",
        "trainer.total_training_steps": steps,
    }
    return ["--config", config, *(f"{k}={v}" for k, v in kw.items())]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_lora_resume_is_bit_exact(demo, tmp_path, torchrun, kind):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    torchrun("train.py", 2, overrides(demo, straight, 4, kind))
    torchrun("train.py", 2, overrides(demo, split, 2, kind))
    torchrun("train.py", 2, overrides(demo, split, 4, kind))
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all("actor/kl_loss" in r and "timing_s/ref" in r for r in a), sorted(a[0])
    assert a[-1]["actor/kl_loss"] > 0.0  # the adapted actor has left its base, the reference
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
    for role, extra in (("actor", set()), ("critic", {"output_layer.weight", "output_layer.bias"})):
        first = torch_dist_tensors(f"{split}/global_step_2/{role}")
        wa, wb = (torch_dist_tensors(f"{d}/global_step_4/{role}") for d in (straight, split))
        adapters = {k for k in wa if k.endswith(("_lora.A", "_lora.B")) or ".lora." in k}
        assert adapters and set(wa) == adapters | extra, sorted(wa)[:8]
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{role}.{k} differs"
        assert any(not torch.equal(wa[k], first[k]) for k in adapters), f"the {role}'s adapters never moved"
        if kind == "moe" and role == "actor":
            assert any(".experts.lora." in k for k in adapters), sorted(adapters)
