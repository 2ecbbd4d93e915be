"""Transformer Engine on the GPU: TE's Linear and fused RMSNorm + Linear against torch on the same bf16
weights, and megatron-core's TE layer spec against its local spec: a small GPTModel's names, logits and
gradients on the same weights. Needs CUDA and Transformer Engine (launch/build_te.sh, docs/gpu.md);
skipped with the reason elsewhere. Runs without SGLang: ``pytest --noconftest tests/gpu/test_te_layers.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.models import te_spec


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    why = te_spec.te_import_error()
    return None if why is None else f"needs Transformer Engine (launch/build_te.sh): {why}"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

BF16 = torch.bfloat16


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-2) -> None:
    """Equal within bf16 rounding: the difference's norm against the reference's."""
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
    assert err.item() < rel, f"relative error {err.item():.3g} >= {rel}"


def test_linear_and_fused_rmsnorm_linear_match_torch():
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    x = torch.randn(4, 64, 256, device="cuda", dtype=BF16)
    lin = te.Linear(256, 512, bias=True, params_dtype=BF16, device="cuda")
    ln = te.LayerNormLinear(
        256, 384, bias=False, normalization="RMSNorm", eps=1e-6, params_dtype=BF16, device="cuda"
    )
    with torch.no_grad():
        ln.layer_norm_weight.copy_(torch.rand(256, device="cuda", dtype=BF16) + 0.5)
    for layer, ref in (
        (lin, lambda x, p: F.linear(x, p["weight"], p["bias"])),
        (ln, lambda x, p: F.linear(F.rms_norm(x, (256,), p["layer_norm_weight"], 1e-6), p["weight"])),
    ):
        params = {n: p.detach().float().clone().requires_grad_() for n, p in layer.named_parameters()}
        xa, xb = x.clone().requires_grad_(), x.float().clone().requires_grad_()
        dy = torch.randn(4, 64, layer.weight.shape[0], device="cuda", dtype=BF16)
        y = layer(xa)
        y.backward(dy)
        y_ref = ref(xb, params)
        y_ref.backward(dy.float())
        _close(y, y_ref)
        _close(xa.grad, xb.grad)
        for n, p in layer.named_parameters():
            _close(p.grad, params[n].grad)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")


def _gpt(spec, vocab: int = 512, moe: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=512,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, bf16=True, params_dtype=BF16, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=True, use_cpu_initialization=False, **(MOE if moe else {}),
    )  # fmt: skip
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=256,
        position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False,
    ).cuda()  # fmt: skip


@pytest.fixture(scope="module")
def world():
    from megatron_rl.parallel import destroy_parallel, init_parallel

    yield init_parallel(1, 1, seed=0, device="cuda")
    destroy_parallel()


def _same_weights(local, te_model) -> dict[str, str]:
    """Random weights in the local model, copied into the TE model under its names; local -> TE names."""
    local_sd = {n: t for n, t in local.state_dict().items() if not te_spec.is_extra_state(n)}
    te_sd = {n: t for n, t in te_model.state_dict().items() if not te_spec.is_extra_state(n)}
    mapped = {n: te_spec.local_to_te_name(n, te_sd) for n in local_sd}
    got = set(mapped.values())
    assert got == set(te_sd), f"only local: {sorted(got - set(te_sd))}; only TE: {sorted(set(te_sd) - got)}"
    assert all(te_spec.te_to_local_name(t) == n for n, t in mapped.items())
    with torch.no_grad():
        for name, tensor in local_sd.items():
            norm = name.endswith("norm.weight")
            tensor.normal_(0.0, 0.5 if norm else 0.05).add_(1.0 if norm else 0.0)
            te_sd[mapped[name]].copy_(tensor)
    return mapped


def test_te_spec_names_logits_and_grads_match_local_spec(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    impl, notice = te_spec.resolve_transformer_impl(None)
    assert impl == te_spec.TRANSFORMER_ENGINE, notice
    local = _gpt(get_gpt_layer_local_spec(normalization="RMSNorm"))
    te_model = _gpt(te_spec.te_layer_spec())
    mapped = _same_weights(local, te_model)
    tokens = torch.randint(0, 512, (2, 128), device="cuda")
    positions = torch.arange(128, device="cuda").expand(2, -1)
    outs = []
    for model in (local, te_model):
        logits = model(tokens, positions, None)
        loss = torch.log_softmax(logits.float(), -1).gather(-1, tokens.roll(-1, 1)[..., None]).mean()
        loss.backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l_logits, l_grads), (t_logits, t_grads) = outs
    _close(t_logits, l_logits)
    for name, grad in l_grads.items():
        assert t_grads[mapped[name]] is not None, name
        _close(t_grads[mapped[name]], grad, rel=5e-2)


def test_te_grouped_experts_match_sequential_experts(world):
    """TE's MoE layer (TEGroupedMLP) against the local one (SequentialMLP) on the same input: the same
    router picks the same experts, so the outputs and gradients differ by bf16 rounding only."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = _gpt(get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"), moe=True)
    te_model = _gpt(te_spec.te_layer_spec(num_experts=4, moe_grouped_gemm=True), moe=True)
    assert type(te_model.decoder.layers[0].mlp.experts).__name__ == "TEGroupedMLP"
    mapped = _same_weights(local, te_model)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mapped.values()  # not fused before a router
    x = torch.randn(128, 2, 256, device="cuda", dtype=BF16)
    dy = torch.randn_like(x)
    outs = []
    for model in (local, te_model):
        xi = x.clone().requires_grad_()
        y = model.decoder.layers[0].mlp(xi)[0]
        y.backward(dy)
        grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("decoder.layers.0.mlp.")}
        outs.append((y.detach(), xi.grad, grads))
    (ly, lx, lg), (ty, tx, tg) = outs
    _close(ty, ly)
    _close(tx, lx)
    assert len(lg) == 1 + 2 * 4  # the router and each expert's two linears
    for name, grad in lg.items():
        _close(tg[mapped[name]], grad, rel=5e-2)
