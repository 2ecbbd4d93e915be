"""trainer.placement.*: how the keys (or the file) resolve against the world size, and the layouts that
cannot work failing in one line naming the key, before any process group starts."""

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.config.placement import resolve_placement

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


def cfg_with(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides])


def test_default_is_every_role_on_every_rank():
    p = resolve_placement(cfg_with(), 4)
    assert p.actor == p.critic == p.rollout == (0, 1, 2, 3) and not p.separate_rollout
    assert p.world_of(3) == (0, 1, 2, 3)


def test_rollout_ranks_of_their_own_leave_the_rest_to_the_actor():
    p = resolve_placement(
        cfg_with("trainer.placement.rollout=[3]", "actor_rollout_ref.rollout.max_staleness=1"), 4
    )
    assert p.actor == p.critic == (0, 1, 2) and p.rollout == (3,) and p.separate_rollout
    assert p.world_of(3) == (3,) and p.world_of(0) == (0, 1, 2)


def test_a_critic_of_its_own_leaves_the_rest_to_the_actor_and_has_its_own_batch_checks():
    cfg = cfg_with("trainer.placement.critic=[1, 2, 3]", "trainer.placement.rollout=[4]")
    p = resolve_placement(cfg, 5)
    assert p.actor == (0,) and p.critic == (1, 2, 3) and p.separate_critic and p.separate_rollout
    assert p.world_of(2) == (1, 2, 3) and p.world_of(0) == (0,) and p.world_of(4) == (4,)
    # the critic's data-parallel size is 3: its mini-batch of 256 prompts (the default) does not split
    with pytest.raises(
        ConfigError,
        match=r"critic\.ppo_mini_batch_size x actor_rollout_ref\.rollout\.n = 256 x 1 = 256 samples must "
        r"be a multiple of the data-parallel size 3 of the critic's ranks",
    ):
        validate(cfg, world_size=5, model_dims=DIMS)
    validate(cfg_with("trainer.placement.critic=[2, 3]"), world_size=4, model_dims=DIMS)


def test_the_file_replaces_the_keys(tmp_path):
    f = tmp_path / "placement.yaml"
    f.write_text("actor: [2, 3]\nrollout: [0, 1]\n")
    p = resolve_placement(cfg_with(f"trainer.placement.file={f}", "trainer.placement.rollout=[3]"), 4)
    assert p.actor == (2, 3) and p.rollout == (0, 1)


def test_batch_sizes_are_checked_against_the_actor_ranks_only():
    # 3 actor ranks: data-parallel size 3 (TP=1), so 16 prompts x rollout.n=1 do not split evenly
    cfg = cfg_with("trainer.placement.rollout=[3]", "data.train_batch_size=16")
    with pytest.raises(
        ConfigError, match=r"= 16 x 1 = 16 samples must be a multiple of the data-parallel size 3"
    ):
        validate(cfg, world_size=4, model_dims=DIMS)
    validate(cfg_with("trainer.placement.rollout=[2, 3]"), world_size=4, model_dims=DIMS)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["trainer.placement.rollout=[4]"], r"trainer\.placement\.rollout=\[4\]: rank 4 does not exist"),
        (["trainer.placement.actor=[0, 0]"], r"lists a rank twice"),
        (["trainer.placement.rollout=[0, 1, 2, 3]", "trainer.placement.actor=[]"], r"non-empty list"),
        (["trainer.placement.actor=[0, 1]", "trainer.placement.rollout=[1, 2, 3]"], r"shares some ranks"),
        (["trainer.placement.actor=[0, 1]", "trainer.placement.rollout=[2]"], r"rank 3 has no role"),
        (
            ["trainer.placement.actor=[0, 1, 2]", "trainer.placement.critic=[2, 3]"],
            r"trainer\.placement\.critic=\[2, 3\] shares some ranks with the actor's \[0, 1, 2\]",
        ),
        (
            ["trainer.placement.rollout=[3]", "trainer.placement.critic=[2, 3]"],
            r"critic=\[2, 3\] shares ranks with trainer\.placement\.rollout=\[3\]",
        ),
        (
            ["trainer.placement.critic=[3]", "algorithm.adv_estimator=grpo"],
            r"trainer\.placement\.critic=\[3\] gives ranks to a critic that does not train",
        ),
        (["actor_rollout_ref.rollout.max_staleness=1"], r"max_staleness=1 .*trainer\.placement\.rollout"),
        (
            ["trainer.placement.rollout=[3]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            r"tensor_model_parallel_size x data_parallel_size = 2 does not divide the 1 rollout ranks",
        ),
        (
            ["trainer.placement.rollout=[3]", "algorithm.filter_groups.enable=true"],
            r"algorithm\.filter_groups\.enable",
        ),
        (
            ["trainer.placement.file=/nonexistent/p.yaml"],
            r"trainer\.placement\.file=/nonexistent/p\.yaml: no such",
        ),
    ],
)
def test_layouts_that_cannot_work_fail_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        resolve_placement(cfg_with(*overrides), 4)


def test_a_bad_file_names_the_file(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("actors: [0]\n")
    with pytest.raises(ConfigError, match=r"trainer\.placement\.file=.*unknown entries \['actors'\]"):
        resolve_placement(cfg_with(f"trainer.placement.file={f}"), 2)
    f.write_text("actor: [0, 5]\nrollout: [1]\n")
    with pytest.raises(ConfigError, match=r"\(actor\)=\[0, 5\]: rank 5 does not exist"):
        resolve_placement(cfg_with(f"trainer.placement.file={f}"), 2)
