"""The trainer's models on Transformer Engine's layers against the same models on megatron-core's local
layers (``*.megatron.override_transformer_config.transformer_impl``), built by ``build_model`` and
filled from one random HF directory: logits and gradients within bf16 rounding (a dense model with a
left-padded row; an MoE model with both routers replaying the same experts, which routes every token
alike whatever the rounding); the reshard stream to the engine bit-identical; torch_dist checkpoints
saved on one implementation load bit-exactly on the other, and read by ckpt_tools' reader. Negative
control: one fused norm weight scaled on the TE side moves the logits far outside the tolerance.
The process holds one cuDNN, torch's, with TE imported.
Packed passes (``*.megatron.use_remove_padding``) give the padded passes' log-probs on both (fp32, with
a leaking packing as the negative control); FP8 training (``override_transformer_config.fp8``) runs a
forward and backward close to bf16's.

Needs CUDA and Transformer Engine (launch/build_te.sh, docs/gpu.md); skipped with the reason elsewhere.
Runs without SGLang: ``pytest --noconftest tests/gpu/test_te_trainer.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import te_spec
from tests.gpu.test_te_layers import _why_not

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]

BF16 = torch.bfloat16
TE, LOCAL = te_spec.TRANSFORMER_ENGINE, te_spec.LOCAL
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def ps():
    from megatron_rl.parallel import destroy_parallel, init_parallel

    yield init_parallel(1, 1, seed=0, device="cuda")
    destroy_parallel()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    moe = dict(DIMS, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
    return {
        "dense": save_random_hf_model(str(root / "qwen2"), "qwen2", seed=1, **DIMS),
        "moe": save_random_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=2, **moe),
    }


def _build(
    path: str, ps, impl: str, role: str = "actor", load: bool = True, dtype=BF16, overrides: tuple = ()
):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights

    args = load_model_args(path)
    # the local MoE model runs megatron's SequentialMLP (one parameter per expert), the TE one the
    # trainer's grouped experts (one per projection): two expert modules checked against each other
    options = TrainingOptions(
        transformer_overrides=(("transformer_impl", impl), *overrides), moe_grouped_gemm=impl == TE
    )
    model = build_model(args, ps, role, dtype=dtype, options=options)
    assert model.transformer_impl == impl
    if load:
        load_hf_weights(model, path, ps)
    return model


def _params(model) -> dict[str, torch.Tensor]:
    from megatron_rl.models.builder import named_global_params

    return named_global_params(model)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 48), generator=g).cuda()
    keep = torch.ones_like(ids)
    keep[0, :10] = 0  # a left-padded prompt
    return ids, keep


def _pass(model, ids, keep, routed=None):
    """Logits and the gradients of the mean next-token log-prob, under the tables' names."""
    from megatron_rl.models import routing
    from megatron_rl.models.forward import causal_padding_mask
    from tests.distributed.workers.grouped_experts import global_grads

    if routed is not None:
        replays = routing.enable_replay(model)
        routing.set_targets(replays, routed, False, 0, 1)
    logits = model(ids, None, causal_padding_mask(keep))
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    (logp * keep[:, 1:]).sum().div(keep[:, 1:].sum()).backward()
    if routed is not None:
        assert all(int(r.recorded) > 0 for r in replays)  # every router took the replayed experts
    assert all(p.grad is not None for p in model.parameters())
    return logits.detach(), global_grads(model)


def test_one_cudnn_in_the_process_torchs(ps):
    """Transformer Engine, imported once the trainer has started, runs on torch's cuDNN and brings no
    second one (``parallel.load_torch_cudnn``); torch's cuDNN stays usable. With TE's search finding the
    system's cuDNN first, torch refuses it or runs on it and its attention falls back to unfused fp32."""
    import transformer_engine.pytorch  # noqa: F401

    from megatron_rl.parallel import cudnn_libraries

    files = cudnn_libraries()
    dirs_ = {f.rsplit("/", 1)[0] for f in files}
    assert len(dirs_) == 1, f"cuDNN libraries from more than one place: {sorted(files)}"
    assert torch.backends.cudnn.version() >= 91200


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_and_gradients_match_the_local_layers(ps, dirs, kind):
    from megatron_rl.models.forward import causal_padding_mask

    local, te_model = _build(dirs[kind], ps, LOCAL), _build(dirs[kind], ps, TE)
    names = {type(m).__name__ for m in te_model.modules()}
    assert "TELayerNormColumnParallelLinear" in names and ("GroupedExperts" in names) == (kind == "moe")
    assert "TEGroupedMLP" not in names  # one GEMM per expert (docs/gpu.md)
    lp, tp = _params(local), _params(te_model)
    assert set(lp) == set(tp)
    assert all(torch.equal(lp[n], tp[n]) for n in lp), "the same HF weights must load bit-identically"
    ids, keep = _batch(DIMS["vocab_size"])
    routed = None
    if kind == "moe":  # both routers replay one random choice of 2 distinct experts per token
        g = torch.Generator().manual_seed(3)
        routed = torch.rand(2, 48, DIMS["num_hidden_layers"], 4, generator=g).argsort(-1)[..., :2].cuda()
    l_logits, l_grads = _pass(local, ids, keep, routed)
    t_logits, t_grads = _pass(te_model, ids, keep, routed)
    err = _rel(t_logits, l_logits)
    print(f"{kind}: logits relative error TE vs local {err:.2e}")
    assert err < 2e-2
    assert set(t_grads) == set(l_grads) and len(l_grads) == len(lp)
    worst = max((_rel(t_grads[n], g), n) for n, g in l_grads.items())
    print(f"{kind}: worst gradient relative error {worst[0]:.2e} ({worst[1]})")
    assert worst[0] < 5e-2, worst
    # negative control: the fused pre-MLP norm of layer 0 (dense) / its input norm (MoE) scaled by 1.5
    norm = "decoder.layers.0." + ("pre_mlp_layernorm.weight" if kind == "dense" else "input_layernorm.weight")
    with torch.no_grad():
        tp[norm].mul_(1.5)
        wrong = te_model(ids, None, causal_padding_mask(keep))
    assert _rel(wrong, l_logits) > 10 * 2e-2


def test_the_reshard_stream_is_the_same_on_both(ps, dirs):
    from megatron_rl.rollout.reshard import iter_hf_buckets

    streams = []
    for impl in (LOCAL, TE):
        model = _build(dirs["moe"], ps, impl)
        streams.append(
            {n: t.clone() for b in iter_hf_buckets(model, ps, 1 << 20, BF16) for n, t in b}  # 1 MiB buckets
        )
    local, te_stream = streams
    assert set(local) == set(te_stream) and len(local) > 10
    assert all(torch.equal(local[n], te_stream[n]) for n in local)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("saved_on", [TE, LOCAL])
def test_a_checkpoint_loads_bit_exactly_on_the_other_layers(ps, dirs, tmp_path, kind, saved_on):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import fill_from_reader
    from megatron_rl.weights.ckpt_write import save_torch_dist
    from megatron_rl.weights.torch_dist import TorchDistReader, load_torch_dist

    other = LOCAL if saved_on == TE else TE
    saver = _build(dirs[kind], ps, saved_on)
    with torch.no_grad():  # weights the HF directory does not hold: the checkpoint must carry them
        for p in _params(saver).values():
            p.add_(torch.randn_like(p), alpha=0.01)
    save_torch_dist(saver, ps, str(tmp_path / "ckpt"))
    want = _params(saver)
    loaded = _build(dirs[kind], ps, other, load=False)
    load_torch_dist(loaded, ps, str(tmp_path / "ckpt"))
    got = _params(loaded)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    # ckpt_tools' mcore-to-hf reads the same files without a model (HF names)
    via_reader = _build(dirs[kind], ps, other, load=False)
    fill_from_reader(via_reader, ps, TorchDistReader(str(tmp_path / "ckpt"), load_model_args(dirs[kind])))
    got = _params(via_reader)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_the_critic_builds_on_te(ps, dirs):
    from megatron_rl.models.forward import causal_padding_mask

    critic = _build(dirs["dense"], ps, TE, role="critic")
    ids, keep = _batch(DIMS["vocab_size"])

    values = critic(ids, None, causal_padding_mask(keep))
    assert values.shape == (2, 48, 1) and torch.isfinite(values).all()


def _ragged_batch(vocab: int):
    """8 sequences: left-padded prompts of 5..24 tokens, right-padded responses of 1..40 tokens."""
    from megatron_rl.batch import RolloutBatch, SeqMeta

    g = torch.Generator().manual_seed(5)
    b, p, r = 8, 24, 40
    p_len, r_len = torch.randint(5, p + 1, (b,), generator=g), torch.randint(1, r + 1, (b,), generator=g)
    p_mask = torch.arange(p)[None] >= (p - p_len[:, None])
    r_mask = torch.arange(r)[None] < r_len[:, None]
    prompts = torch.where(p_mask, torch.randint(3, vocab, (b, p), generator=g), 0)
    responses = torch.where(r_mask, torch.randint(3, vocab, (b, r), generator=g), 0)
    meta = [SeqMeta(uid=str(i)) for i in range(b)]
    return RolloutBatch.from_tokens(prompts, p_mask, responses, r_mask, meta).to("cuda")


@pytest.mark.parametrize("impl", [LOCAL, TE])
def test_packed_log_probs_equal_the_padded_ones(ps, dirs, impl, monkeypatch):
    from megatron_rl.microbatches import MicroBatching
    from megatron_rl.models import packing
    from megatron_rl.ppo import compute_log_probs

    model = _build(dirs["dense"], ps, impl, dtype=torch.float32)
    batch = _ragged_batch(DIMS["vocab_size"])
    keep = batch.response_mask.bool()

    def log_probs(packed: bool, micro: MicroBatching) -> torch.Tensor:
        model.packed_sequences = packed
        with torch.no_grad():
            return compute_log_probs(model, ps, batch, micro)[keep]

    padded = log_probs(False, MicroBatching(3))
    for micro in (MicroBatching(3), MicroBatching(1, max_tokens=128, key="k")):
        diff = (log_probs(True, micro) - padded).abs().max().item()
        print(f"{impl}: packed vs padded log-probs, max diff {diff:.2e}")
        assert diff < 2e-3
    # negative control: every micro-batch one segment (sequences attend to each other, RoPE runs on)
    real = packing.pack

    def leaking(*args, **kwargs):
        p = real(*args, **kwargs)
        p.params.bounds = (0, p.tokens)
        cu = torch.tensor([0, p.tokens], dtype=torch.int32, device=p.ids.device)
        p.params.cu_seqlens_q = p.params.cu_seqlens_kv = cu
        p.params.max_seqlen_q = p.params.max_seqlen_kv = p.tokens
        return p

    monkeypatch.setattr(packing, "pack", leaking)
    assert (log_probs(True, MicroBatching(3)) - padded).abs().max().item() > 0.1


def test_fp8_training_runs_close_to_bf16(ps, dirs):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs an Ada, Hopper or newer GPU")
    bf16 = _build(dirs["dense"], ps, TE)
    fp8 = _build(dirs["dense"], ps, TE, overrides=(("fp8", "hybrid"), ("fp8_recipe", "tensorwise")))
    assert fp8.config.fp8 == "hybrid"
    ids, keep = _batch(DIMS["vocab_size"])  # 48 tokens a row: a multiple of 16
    want, want_grads = _pass(bf16, ids, keep)
    got, grads = _pass(fp8, ids, keep)
    err = _rel(got, want)
    print(f"fp8: logits relative error vs bf16 {err:.2e}")
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert err < 0.1 and set(grads) == set(want_grads)
