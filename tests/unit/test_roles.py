"""The roles floor: the critic protocol's handles, the checkpoint registry on real files, placement
routing and the engine count, and the one reward protocol."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist

from megatron_rl.config.placement import Placement
from megatron_rl.roles.critic import CriticRole, Done, LocalCritic, NullCritic, Pending, RemoteCritic
from megatron_rl.run.state import SHARD, SHARED, StateRegistry, Value


def test_null_critic_is_a_critic_role_with_empty_handles():
    c = NullCritic()
    assert isinstance(c, CriticRole) and c.model is None and c.optim is None
    assert c.values_async(1, None, None).result() is None
    assert c.update_async(1, None, None).result() == {}
    reg = StateRegistry()
    c.register_state(reg)
    assert reg.names() == []  # nothing in the checkpoint


def test_both_rollout_placements_implement_the_rollout_role():
    """Every method of RolloutRole, with its parameters, on ColocatedRollout and SeparateRollout."""
    import inspect

    from megatron_rl.roles.rollout import ColocatedRollout, RolloutRole, SeparateRollout

    members = [n for n, v in vars(RolloutRole).items() if not n.startswith("_") and callable(v)]
    assert {"start", "prompts", "batch", "generate", "policy_updated", "shutdown"} <= set(members)
    for cls in (ColocatedRollout, SeparateRollout):
        for name in members:
            want = list(inspect.signature(getattr(RolloutRole, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)


def test_a_rollout_request_names_itself_as_the_old_tags():
    from dataclasses import replace

    from megatron_rl.roles.rollout import Request

    assert str(Request("train", 3)) == "train/3" and str(Request("val", 3)) == "val/3"
    assert str(replace(Request("val", 3), seq=2)) == "val/3/2"
    assert Request("train", 3).trains and not Request("sync_check", 3).trains
    assert len({Request("train", 3), Request("train", 3), Request("val", 3)}) == 2
    with pytest.raises(AttributeError):
        Request("train", 3).step = 4  # type: ignore[misc]


def test_pending_waits_once_and_done_is_immediate():
    calls = []
    p = Pending(lambda: calls.append(1) or 7)
    assert calls == []  # posted, not waited on
    assert p.result() == 7 and p.result() == 7 and calls == [1]
    assert Done(3).result() == 3


def test_every_critic_kind_declares_the_protocol():
    for cls in (LocalCritic, RemoteCritic, NullCritic):
        for name in ("values_async", "update_async", "register_state", "shutdown"):
            assert callable(getattr(cls, name)), (cls, name)


def test_models_hold_no_critic_handle():
    """The critic's module lives in the critic role only (Models used to carry a second handle)."""
    import dataclasses

    from megatron_rl.roles.models import Models

    assert {f.name for f in dataclasses.fields(Models)} == {"actor", "actor_optim", "ref", "reward"}


def test_role_of_routes_ranks_and_world_of_follows_it():
    p = Placement(5, actor=(0,), critic=(1, 2), rollout=(3, 4))
    assert [p.role_of(r) for r in range(5)] == ["actor", "critic", "critic", "rollout", "rollout"]
    assert p.world_of(2) == (1, 2) and p.world_of(4) == (3, 4) and p.world_of(0) == (0,)
    colocated = Placement(2, actor=(0, 1), critic=(0, 1), rollout=(0, 1))
    assert {colocated.role_of(r) for r in range(2)} == {"actor"}


def test_engine_count_has_one_home():
    from megatron_rl.config import ConfigError

    p = Placement(5, actor=(0,), critic=(0,), rollout=(1, 2, 3, 4))
    assert p.rollout_engines(1) == 4 and p.rollout_engines(2) == 2
    with pytest.raises(ConfigError, match="tensor_model_parallel_size x data_parallel_size = 3 does not"):
        p.rollout_engines(3)


class _Counter:
    def __init__(self, v):
        self.v = v

    def state_dict(self):
        return {"v": self.v}

    def load_state_dict(self, s):
        self.v = s["v"]


class _Queue:
    def __init__(self, q):
        self.q = q

    def state_dict(self):
        return self.q

    def load_state_dict(self, s):
        self.q = s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_registry_round_trip_keeps_the_on_disk_names(tmp_path, gloo_world_of_one):
    """Save and resume walk the registry; the files and keys are the checkpoint's documented ones."""
    from megatron_rl.errors import CheckpointError
    from megatron_rl.run.checkpoint import SHARED_FILE, CheckpointManager

    class PS:
        rank = dp_rank = tp_rank = pp_rank = 0
        tp_size = pp_size = dp_size = world_size = 1

    ckpt = CheckpointManager(str(tmp_path), PS(), permissions="0600")
    reg = StateRegistry()
    sampler, kl, queue, counters = _Counter(5), _Counter(0.25), _Queue({3: {"version": 2}}), _Counter(9)
    seen = []
    reg.register("sampler", sampler)
    reg.register("kl_ctrl", kl)
    reg.register("train_data", Value("abc", lambda saved, path: seen.append(saved)))
    reg.register("rollout_queue", queue, SHARED)
    reg.register("critic_optim", counters, SHARD)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("sampler", sampler)
    path = reg.save(ckpt, 4, extra={"metrics_row": {"a": 1.0}})
    assert os.path.basename(path) == "global_step_4"
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["sampler"] == {"v": 5} and state["kl_ctrl"] == {"v": 0.25} and state["train_data"] == "abc"
    assert state["global_step"] == 4 and state["metrics_row"] == {"a": 1.0}
    assert torch.load(os.path.join(path, SHARED_FILE)) == {"rollout_queue": {3: {"version": 2}}}
    shard = torch.load(os.path.join(path, "mp_rank_00_000.pt"), weights_only=False)
    assert shard["critic_optim"] == {"v": 9} and "rng" in shard
    sampler.v, kl.v, queue.q, counters.v = 0, 0.0, None, 0
    back = reg.load(ckpt, path)
    assert (sampler.v, kl.v, queue.q, counters.v) == (5, 0.25, {3: {"version": 2}}, 9)
    assert back["global_step"] == 4 and seen == ["abc"]
    # a piece registered now but absent from the checkpoint (e.g. a critic the run did not have)
    reg.register("other", _Counter(1), SHARD)
    with pytest.raises(CheckpointError, match="holds no other state"):
        reg.load(ckpt, path)


def test_every_reward_source_declares_the_protocol():
    from megatron_rl.reward.http import HttpRewardManager
    from megatron_rl.reward.model import ModelReward
    from megatron_rl.reward.rules import RewardManager
    from megatron_rl.reward.source import RewardSource

    for cls in (RewardManager, HttpRewardManager, ModelReward):
        assert issubclass(cls, RewardSource)
        assert "score_batch" in cls.__dict__ and isinstance(cls.collective, bool)
    assert ModelReward.collective and not RewardManager.collective and HttpRewardManager.needs_prompts
    src = open(os.path.join(os.path.dirname(__file__), "../../megatron_rl/reward/scoring.py")).read()
    assert 'getattr(reward_fn, "collective"' not in src and 'getattr(reward_fn, "needs_prompts"' not in src
