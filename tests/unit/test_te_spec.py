"""The choice between Transformer Engine's layers and megatron-core's local ones (verl's
``*.megatron.override_transformer_config.transformer_impl``), and the names that differ between them.
The layers themselves run in tests/gpu/test_te_layers.py (where TE is installed)."""

from __future__ import annotations

import pytest

from megatron_rl.config.errors import ConfigError
from megatron_rl.models import te_spec

HAVE_TE = te_spec.te_import_error() is None
needs_no_te = pytest.mark.skipif(
    HAVE_TE, reason="Transformer Engine imports here: the fallback cannot be seen"
)
needs_te = pytest.mark.skipif(
    not HAVE_TE, reason=f"needs Transformer Engine (launch/build_te.sh): {te_spec.te_import_error()}"
)


@needs_no_te
def test_without_te_the_default_is_local_with_the_reason_in_one_line():
    impl, notice = te_spec.resolve_transformer_impl(None)
    assert impl == "local"
    assert "Transformer Engine does not import" in notice and "\n" not in notice


@needs_no_te
def test_asking_for_te_without_it_names_the_key_and_both_fixes():
    key = "actor_rollout_ref.actor.megatron.override_transformer_config.transformer_impl"
    with pytest.raises(ConfigError) as err:
        te_spec.resolve_transformer_impl("transformer_engine", key)
    assert key + "=transformer_engine" in str(err.value)
    assert "launch/build_te.sh" in str(err.value) and key + "=local" in str(err.value)


@needs_no_te
def test_the_te_layer_spec_without_te_says_why():
    with pytest.raises(RuntimeError, match="needs Transformer Engine"):
        te_spec.te_layer_spec()


@needs_te
def test_with_te_the_default_is_transformer_engine():
    impl, notice = te_spec.resolve_transformer_impl(None)
    assert impl == "transformer_engine" and "\n" not in notice
    assert te_spec.resolve_transformer_impl("transformer_engine")[0] == "transformer_engine"


def test_local_is_always_available_and_unknown_values_are_refused():
    impl, notice = te_spec.resolve_transformer_impl("local")
    assert impl == "local" and "transformer_impl=local" in notice
    with pytest.raises(ConfigError, match=r"transformer_impl='te': choose one of transformer_engine, local"):
        te_spec.resolve_transformer_impl("te")


L = "decoder.layers.1."


@pytest.mark.parametrize(
    "local, te",
    [
        (L + "input_layernorm.weight", L + "self_attention.linear_qkv.layer_norm_weight"),
        (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
        (L + "mlp.experts.local_experts.3.linear_fc1.weight", L + "mlp.experts.linear_fc1.weight3"),
        (L + "mlp.experts.local_experts.12.linear_fc2.weight", L + "mlp.experts.linear_fc2.weight12"),
        (L + "self_attention.linear_qkv.weight", L + "self_attention.linear_qkv.weight"),
        (L + "mlp.router.weight", L + "mlp.router.weight"),
        ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
        ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ],
)
def test_names_map_both_ways(local, te):
    assert te_spec.local_to_te_name(local) == te
    assert te_spec.te_to_local_name(te) == local


def test_a_norm_stays_where_the_te_model_keeps_it():
    """A mixture-of-experts layer keeps its pre-MLP norm (the router reads its output); given the TE
    model's names, only the norms it fused move."""
    te_names = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
    }
    assert te_spec.local_to_te_name("decoder.layers.0.pre_mlp_layernorm.weight", te_names) == (
        "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert te_spec.local_to_te_name("decoder.layers.0.input_layernorm.weight", te_names) == (
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )


def test_extra_state_entries_are_recognised():
    assert te_spec.is_extra_state("decoder.layers.0.self_attention.linear_qkv._extra_state")
    assert not te_spec.is_extra_state("decoder.layers.0.self_attention.linear_qkv.weight")
