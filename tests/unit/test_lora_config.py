"""LoRA's config section: which of megatron's linears take adapters (verl's names, HF names, all-linear,
verl's wildcard patterns) and the one-line refusals; a pattern picks one layer's linear in a built
model (a world of one)."""

import pytest

from megatron_rl.config import Config, ConfigError
from megatron_rl.config.lora import (
    LINEARS,
    MLA_LINEARS,
    EngineLora,
    LoraConfig,
    check_lora,
    engine_lora_of,
    lora_targets,
)

KEY = "actor_rollout_ref.model.lora"


@pytest.mark.parametrize(
    "names, want",
    [
        (list(LINEARS), LINEARS + MLA_LINEARS),  # linear_qkv stands for MLA's q/kv projections too
        (["all-linear"], LINEARS + MLA_LINEARS),
        (["q_proj", "k_proj", "v_proj", "down_proj"], ("linear_qkv", "linear_fc2", *MLA_LINEARS)),
        (["gate_proj", "up_proj"], ("linear_fc1",)),
        (["linear_kv_down_proj"], ("linear_kv_down_proj",)),
        (["linear_proj", "*.layers.0.*.linear_qkv"], ("linear_proj", "*.layers.0.*.linear_qkv")),
    ],
)
def test_targets(names, want):
    assert lora_targets(LoraConfig(rank=8, target_modules=names), KEY) == want


@pytest.mark.parametrize(
    "names, match",
    [
        (
            ["q_proj", "v_proj"],
            r"target_modules names q_proj, v_proj but not k_proj: .* one fused linear_qkv",
        ),
        (["gate_proj"], r"but not up_proj"),
        (["lm_head"], r"unknown module 'lm_head'"),
        (["*.layers.0.*"], r"names no linear a pattern can pick"),
    ],
)
def test_refused_targets(names, match):
    with pytest.raises(ConfigError, match=match):
        lora_targets(LoraConfig(rank=8, target_modules=names), KEY)


def test_merge_false_is_refused_naming_the_key_where_the_engine_is_apart():
    cfg = Config()
    cfg.actor_rollout_ref.model.lora = LoraConfig(rank=4, merge=False)
    cfg.trainer.placement.rollout = [1]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.lora.merge=false: .*colocated"):
        check_lora(cfg)
    cfg.actor_rollout_ref.model.lora = LoraConfig(rank=4)  # the default: merged into the stream
    check_lora(cfg)
    assert engine_lora_of(cfg) is None


def test_the_engine_is_told_what_adapters_come_unmerged():
    cfg = Config()
    cfg.actor_rollout_ref.model.lora = LoraConfig(
        rank=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], merge=False
    )
    cfg.critic.model.lora = LoraConfig(rank=4, merge=False)  # the critic never reaches an engine
    check_lora(cfg)
    assert engine_lora_of(cfg) == EngineLora(8, ("down_proj", "k_proj", "q_proj", "v_proj"))
    cfg.actor_rollout_ref.model.lora = LoraConfig(rank=8, target_modules=["all-linear"])  # merged
    assert engine_lora_of(cfg) is None
    cfg.actor_rollout_ref.model.lora = LoraConfig(
        rank=8, target_modules=["*.layers.0.*.linear_fc1"], merge=False
    )
    assert engine_lora_of(cfg) == EngineLora(8, ("gate_proj", "up_proj"))
    cfg.actor_rollout_ref.model.lora = LoraConfig(rank=0, merge=False)  # no adapters
    assert engine_lora_of(cfg) is None


@pytest.mark.parametrize("arch, why", [("qwen2_moe", "mixture-of-experts"), ("deepseek_v3", "multi-latent")])
def test_unmerged_adapters_refused_where_the_engine_cannot_take_them(tmp_path, arch, why):
    from types import SimpleNamespace

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.lora import LoraSpec
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.rollout.lora_sync import unmerged, unsupported

    args = load_model_args(save_random_hf_model(str(tmp_path / arch), arch, seed=1))
    assert why in (unsupported(args) or "")
    engine = SimpleNamespace(takes_adapters=True)
    actor = SimpleNamespace(args=args, lora=LoraSpec(4, 8.0, ("linear_qkv",), "base", merge=False))
    with pytest.raises(
        ValueError, match=rf"actor_rollout_ref.model.lora.merge=false: .*{why}.*set it to true"
    ):
        unmerged(actor, engine)
    actor.lora = LoraSpec(4, 8.0, ("linear_qkv",), "base")  # the default: the merged stream
    assert not unmerged(actor, engine)
    dense = load_model_args(save_random_hf_model(str(tmp_path / "qwen2"), "qwen2", seed=1))
    assert unsupported(dense) is None
    unmerged_dense = LoraSpec(4, 8.0, ("linear_qkv",), "base", merge=False)
    assert unmerged(SimpleNamespace(args=dense, lora=unmerged_dense), engine)
    with pytest.raises(ValueError, match=r"merge=false: the rollout engine .* was not started with LoRA"):
        unmerged(SimpleNamespace(args=dense, lora=unmerged_dense), SimpleNamespace())


def test_a_pattern_picks_one_layers_linear(ps, tmp_path):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.lora import adapters, add_adapters
    from megatron_rl.models.random_hf import save_random_hf_model

    path = save_random_hf_model(str(tmp_path / "llama"), "llama", seed=1)
    model = build_model(load_model_args(path), ps, options=TrainingOptions(lora=True))
    load_hf_weights(model, path, ps)
    spec = LoraConfig(rank=4, target_modules=["linear_fc2", "*.layers.1.*.linear_qkv"])
    add_adapters(model, spec, ps, KEY, path, seed=0)
    names = sorted(name for name, _ in adapters(model))
    layers = model.args.num_layers
    assert names == sorted(
        [f"decoder.layers.{i}.mlp.linear_fc2" for i in range(layers)]
        + ["decoder.layers.1.self_attention.linear_qkv"]
    )
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith(("_lora.A", "_lora.B")) for n in trained)
