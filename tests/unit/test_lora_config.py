"""LoRA's config section: which of megatron's linears take adapters (verl's names, HF names, all-linear,
verl's wildcard patterns) and the one-line refusals; a pattern picks one layer's linear in a built
model (a world of one)."""

import pytest

from megatron_rl.config import Config, ConfigError
from megatron_rl.config.lora import LINEARS, MLA_LINEARS, LoraConfig, check_lora, lora_targets

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


def test_merge_false_is_refused_naming_the_key():
    cfg = Config()
    cfg.critic.model.lora = LoraConfig(rank=4, merge=False)
    with pytest.raises(ConfigError, match=r"critic.model.lora.merge=false"):
        check_lora(cfg)
    cfg.critic.model.lora = LoraConfig(rank=0, merge=False)  # LoRA off: nothing to check
    check_lora(cfg)


def test_a_pattern_picks_one_layers_linear(ps, tmp_path):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.lora import adapters, add_adapters
    from megatron_rl.models.random_hf import save_random_hf_model

    path = save_random_hf_model(str(tmp_path / "llama"), "llama", seed=1)
    model = build_model(load_model_args(path), ps)
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
