"""Interleaved pipelines in the config and the plans: verl's virtual_pipeline_model_parallel_size is
read, each virtual stage's layers are megatron-core's own (its layer offsets are the oracle), bad
layouts are one line naming the keys, micro-batch counts fit PP, and the weight stream's bucket plan
walks the virtual stages in model order."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, validate
from megatron_rl.config.layout import pipeline_split
from tests.unit.test_config import cfg_with

VPP = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
PP = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"
DIMS8 = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_layers": 8}


@pytest.mark.parametrize(
    "layers,pp,vpp,first,last",
    [(8, 2, 2, None, None), (8, 2, 4, None, None), (8, 2, 2, 2, None), (12, 3, 2, 2, 2), (20, 4, 2, None, 2)],
)
def test_virtual_stages_hold_megatrons_layers(layers, pp, vpp, first, last):
    """Chunk v of pipeline rank p starts where megatron-core's get_transformer_layer_offset says."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    split = pipeline_split(layers, pp, first, last, vpp)
    assert len(split) == pp * vpp and sum(split) == layers
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    for v in range(vpp):
        for p in range(pp):
            assert sum(split[: v * pp + p]) == get_transformer_layer_offset(config, v, p), (v, p)
    # each pipeline rank holds as many layers as without interleaving
    assert [sum(split[p::pp]) for p in range(pp)] == list(pipeline_split(layers, pp, first, last))


def test_a_chunk_count_that_does_not_divide_a_stage_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=3 must divide"):
        pipeline_split(8, 2, vpp=3)
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size > 1"):
        pipeline_split(8, 1, vpp=2)


def test_verls_key_is_read_and_shared_by_the_models():
    cfg = cfg_with(f"{PP}=2", f"{VPP}=2")
    validate(cfg, 2, DIMS8)
    for m in (cfg.actor_rollout_ref.ref.megatron, cfg.critic.megatron, cfg.reward_model.megatron):
        assert m.virtual_pipeline_model_parallel_size == 2  # None: the actor's
    with pytest.raises(ConfigError, match="critic.megatron.virtual_pipeline_model_parallel_size = 1 differs"):
        validate(cfg_with(f"{PP}=2", f"{VPP}=2", "critic.megatron.virtual_pipeline_model_parallel_size=1"), 2)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([f"{PP}=1", f"{VPP}=2"], "needs pipeline_model_parallel_size > 1"),
        # 8 layers, 4 per stage: 3 chunks do not divide them
        ([f"{PP}=2", f"{VPP}=3"], f"{VPP}=3 must divide"),
        # 16 samples / 2 ranks... DP 1 here: 8 x 2 / 1 = 16 sequences / 16 = 1 micro-batch, not 2
        (
            [f"{PP}=2", f"{VPP}=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 gives 1 micro-batch(es)",
        ),
    ],
)
def test_layouts_interleaving_cannot_run_are_one_line_naming_the_keys(overrides, needle):
    base = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    base += ["actor_rollout_ref.rollout.n=2", "critic.enable=false"]
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(*base, *overrides), 2, DIMS8)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_lora_runs_on_model_chunks():
    ok = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.enable=false"]
    validate(cfg_with(*ok, f"{PP}=2", f"{VPP}=2", "actor_rollout_ref.model.lora.rank=8"), 2, DIMS8)


def test_dynamic_batching_is_not_held_to_the_fixed_count():
    ok = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.enable=false"]
    ok += [f"{PP}=2", f"{VPP}=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]
    validate(cfg_with(*ok, "actor_rollout_ref.actor.use_dynamic_bsz=true"), 2, DIMS8)


def test_token_budget_groups_are_split_to_a_multiple_of_pp():
    from megatron_rl.batch import RolloutBatch, SeqMeta
    from megatron_rl.microbatches import MicroBatching, plan

    n, p, r = 5, 3, 4
    prompts = torch.ones(n, p, dtype=torch.long)
    responses = torch.ones(n, r, dtype=torch.long)
    resp_mask = torch.arange(r)[None] < torch.tensor([4, 1, 2, 3, 4])[:, None]
    batch = RolloutBatch.from_tokens(
        prompts,
        torch.ones(n, p, dtype=torch.bool),
        responses,
        resp_mask,
        [SeqMeta(uid=str(i)) for i in range(n)],
    )
    mb = MicroBatching(size=1, max_tokens=100, key="k")
    assert len(plan(batch, mb, 1)) == 1  # the budget holds every sequence
    groups = plan(batch, mb, 1, count_multiple=4)
    assert len(groups) == 4 and sorted(i for g in groups for i in g) == list(range(n))
    with pytest.raises(ConfigError, match="cannot make 6 micro-batches"):
        plan(batch, mb, 1, count_multiple=6)


def test_the_bucket_plan_walks_the_virtual_stages_in_model_order():
    """PP2 x VPP2 over 4 layers: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3; the buckets come
    in layer order, each marked with the pipeline rank that holds (and broadcasts) it."""
    from megatron_rl.rollout.bucket_plan import plan_buckets
    from megatron_rl.weights.tables import hf_shapes, layer_index
    from tests.unit.test_rollout_plan import args_of

    args = args_of("LlamaForCausalLM")  # 4 layers
    plan = plan_buckets(args, 1, 2, 20_000, itemsize=2, stage_layers=(1, 1, 1, 1))
    names = [t.name for b in plan for s in b.params for t in s.tensors]
    assert len(names) == len(set(names)) and set(names) == set(hf_shapes(args))
    order = []
    for b in plan:
        for s in b.params:
            i = layer_index(s.layout.name)
            if i is not None:
                assert i % 2 == b.stage, (b.stage, s.layout.name)
                order.append(i)
            elif s.layout.name.startswith("embedding."):
                assert b.stage == 0
            else:  # the final norm and the LM head: the last virtual stage, on rank 1
                assert b.stage == 1, s.layout.name
    assert order == sorted(order)


def test_a_critic_on_ranks_of_its_own_is_held_to_its_own_count():
    """The critic's 2 ranks (PP2: DP 1) take a mini-batch's 16 sequences in one micro-batch of 16: not
    a multiple of PP; the actor's 4 micro-batches of 4 fit."""
    cfg = cfg_with(
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "trainer.placement.actor=[0,1]",
        "trainer.placement.critic=[2,3]",
        f"{PP}=2",
        f"{VPP}=2",
    )
    with pytest.raises(ConfigError, match="critic.ppo_micro_batch_size_per_gpu=16 gives 1 micro-batch"):
        validate(cfg, 4, DIMS8)
