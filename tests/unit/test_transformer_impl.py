"""verl's ``*.megatron.override_transformer_config.transformer_impl`` from the command line to the
model builder: ``local`` builds the same model as no key at all (where Transformer Engine does not
import), ``transformer_engine`` without it is refused in one line naming the key and both fixes, MLA
and LoRA pick the local layers when the key is unset and are refused with ``transformer_engine``, and
the TE model's parameter names map onto the layout tables' names. The TE layers themselves run in
tests/gpu/test_te_trainer.py."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.config.errors import ConfigError
from megatron_rl.models import te_spec

HAVE_TE = te_spec.te_import_error() is None
needs_no_te = pytest.mark.skipif(
    HAVE_TE, reason="Transformer Engine imports here: the fallback cannot be seen"
)
KEY = "actor_rollout_ref.actor.megatron.override_transformer_config.transformer_impl"
IDS = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2", num_hidden_layers=2)


def _actor(ps, hf_dir, overrides: list[str]):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.roles.models import _model

    mcfg = load_config(None, overrides).actor_rollout_ref.actor.megatron
    return _model(ps, load_model_args(hf_dir), "actor", hf_dir, mcfg)


def _logits(model) -> torch.Tensor:
    from megatron_rl import cpu_bridge
    from megatron_rl.models.forward import causal_padding_mask

    with cpu_bridge.device_mode(), torch.no_grad():
        return model(IDS, None, causal_padding_mask(torch.ones_like(IDS)))


def test_the_key_is_kept_for_the_builder():
    mcfg = load_config(None, ["+" + KEY + "=local"]).actor_rollout_ref.actor.megatron
    assert mcfg.override_transformer_config["transformer_impl"] == "local"


@needs_no_te
def test_local_is_the_model_built_without_the_key(ps, hf_dir, capsys):
    te_spec._ANNOUNCED.clear()  # printed once per process: this test may not be the first to build
    plain = _actor(ps, hf_dir, [])
    assert "Transformer Engine" not in capsys.readouterr().out  # said once at start-up, on GPU runs
    local = _actor(ps, hf_dir, ["+" + KEY + "=local"])
    assert "transformer_impl=local" in capsys.readouterr().out
    assert plain.transformer_impl == local.transformer_impl == "local"
    assert torch.equal(_logits(plain), _logits(local))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in local.named_parameters()]


@needs_no_te
def test_transformer_engine_without_it_is_refused_in_one_line(ps, hf_dir):
    with pytest.raises(ConfigError) as err:
        _actor(ps, hf_dir, ["+" + KEY + "=transformer_engine"])
    msg = str(err.value)
    assert (
        "\n" not in msg and "transformer_impl=transformer_engine" in msg and "transformer_impl=local" in msg
    )


def test_unknown_values_are_refused(ps, hf_dir):
    with pytest.raises(ConfigError, match="transformer_impl='te': choose one of"):
        _actor(ps, hf_dir, ["+" + KEY + "=te"])


@pytest.mark.parametrize("what, words", [("mla", "multi-latent attention"), ("lora", "LoRA")])
def test_mla_and_lora_take_the_local_layers(what, words):
    impl, notice = te_spec.choose_impl(None, local_only={what})
    assert impl == "local" and words in notice and "\n" not in notice
    assert te_spec.choose_impl("local", local_only={what})[0] == "local"
    with pytest.raises(ConfigError) as err:
        te_spec.choose_impl("transformer_engine", te_spec.KEY, local_only={what})
    assert words in str(err.value) and te_spec.KEY + "=local" in str(err.value)
    with pytest.raises(ConfigError, match="choose one of"):
        te_spec.choose_impl("te", local_only={what})


def test_lora_on_a_te_model_is_refused_in_one_line(ps, hf_dir):
    """The builder never hands add_adapters a TE model (LoRA picks the local layers); called directly
    on one, it refuses before touching a parameter."""
    from megatron_rl.config.lora import LoraConfig
    from megatron_rl.models.lora import add_adapters

    model = _actor(ps, hf_dir, [])
    model.transformer_impl = "transformer_engine"
    try:
        with pytest.raises(
            ConfigError, match=r"actor_rollout_ref.model.lora.rank=8: .*transformer_impl=local"
        ):
            add_adapters(model, LoraConfig(rank=8), ps, "actor_rollout_ref.model.lora", hf_dir, 0)
        assert all(p.requires_grad for p in model.parameters())
    finally:
        model.transformer_impl = "local"


def test_a_te_models_names_map_onto_the_tables():
    te_names = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 1,
        "decoder.layers.0.self_attention.linear_qkv._extra_state": 2,
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": 3,
        "decoder.layers.1.mlp.experts.linear_fc2.weight3": 4,
        "decoder.layers.1.pre_mlp_layernorm.weight": 5,
        "decoder.final_layernorm.weight": 6,
    }
    assert te_spec.te_global_names(te_names) == {
        "decoder.layers.0.input_layernorm.weight": 1,
        "decoder.layers.0.pre_mlp_layernorm.weight": 3,
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight": 4,
        "decoder.layers.1.pre_mlp_layernorm.weight": 5,
        "decoder.final_layernorm.weight": 6,
    }


def test_the_notice_is_printed_once_on_rank_zero(capsys):
    te_spec.announce("megatron-rl: a notice for this test", 1)
    te_spec.announce("megatron-rl: a notice for this test", 0)
    te_spec.announce("megatron-rl: a notice for this test", 0)
    assert capsys.readouterr().out.count("a notice for this test") == 1


def test_a_moe_checkpoint_with_the_te_norm_names_loads_on_the_local_layers(ps, tmp_path):
    """Transformer Engine's MoE layers save their pre-MLP norm as ``pre_mlp_layernorm.weight`` (no
    linear follows it), megatron-core's local ones as ``mlp.linear_fc1.layer_norm_weight``: a checkpoint
    written with TE's keys (here: the local model's entries under them, as the H200 run saw TE write
    them) loads on the local layers bit-exactly, and the alias maps both ways."""
    from megatron.core import dist_checkpointing

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights, named_global_params
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.weights.ckpt_format import norm_key_alias
    from megatron_rl.weights.torch_dist import load_torch_dist

    fused, own = (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
    )
    assert norm_key_alias(fused) == own and norm_key_alias(own) == fused
    assert norm_key_alias("decoder.layers.0.mlp.router.weight") is None
    path = save_random_hf_model(str(tmp_path / "moe"), "qwen3_moe", seed=3, num_hidden_layers=2)
    args = load_model_args(path)
    saved = build_model(args, ps)
    load_hf_weights(saved, path, ps)
    sharded = saved.sharded_state_dict()
    renamed = 0
    for sh in sharded.values():
        if getattr(sh, "key", "").endswith("mlp.linear_fc1.layer_norm_weight"):
            sh.key = norm_key_alias(sh.key)
            renamed += 1
    assert renamed == 2  # each MoE layer's pre-MLP norm
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save({"model": sharded}, str(tmp_path / "ckpt"))
    loaded = build_model(args, ps)
    load_torch_dist(loaded, ps, str(tmp_path / "ckpt"))
    want, got = named_global_params(saved), named_global_params(loaded)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert not torch.equal(got[own], torch.ones_like(got[own]))  # the norm came from the file


FP8 = "actor_rollout_ref.actor.megatron.override_transformer_config.fp8"


def test_fp8_keys_are_kept_for_megatron_cores_config():
    mcfg = load_config(
        None, ["+" + FP8 + "=hybrid", "+" + FP8 + "_recipe=tensorwise"]
    ).actor_rollout_ref.actor
    assert mcfg.megatron.override_transformer_config == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}


@needs_no_te
def test_fp8_on_the_local_layers_is_refused_naming_the_key_and_why(ps, hf_dir):
    with pytest.raises(ConfigError) as err:
        _actor(ps, hf_dir, ["+" + FP8 + "=hybrid"])
    msg = str(err.value)
    assert "\n" not in msg and "override_transformer_config.fp8='hybrid'" in msg
    assert "Transformer Engine does not import" in msg and "launch/build_te.sh" in msg


@pytest.mark.parametrize(
    "fp8, tp, sp, want", [(None, 2, True, 2), ("hybrid", 1, False, 16), ("e4m3", 2, True, 32)]
)
def test_fp8_pads_each_ranks_tokens_to_a_multiple_of_16(fp8, tp, sp, want):
    from types import SimpleNamespace

    from megatron_rl.models.forward import sequence_multiple

    model = SimpleNamespace(config=SimpleNamespace(fp8=fp8, sequence_parallel=sp))
    assert sequence_multiple(model, SimpleNamespace(tp_size=tp)) == want
