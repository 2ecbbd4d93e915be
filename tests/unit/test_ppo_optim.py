"""The optimizer (LR schedule, weight-decay groups, clipping, DDP gradient buffers, fp32 masters,
checkpoints) and the PPO update's batch-size checks, in one process (DP = TP = PP = 1).

The model is a megatron GPTModel trained through megatron-core's DDP and optimizer, as in the trainer.
The distributed parts (DP sum, distributed optimizer, TP/SP reductions, tied-embedding sum, TP/PP grad
norm) are checked against an unsharded run in tests/distributed/test_ppo_layouts.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import ActorConfig, ConfigError, CriticConfig, OptimConfig
from megatron_rl.optim import LRSchedule, ModelOptimizer
from megatron_rl.ppo import update_actor, update_critic

PS1 = SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, tp_rank=0, pp_rank=0, dp_rank=0)


def lrs(total: int, **kw) -> list[float]:
    s = LRSchedule(OptimConfig(**kw), total)
    return [s.lr_at(k) for k in range(total)]


def test_lr_schedules_by_hand():
    assert lrs(3, lr=1.0, lr_warmup_steps=0) == [1.0, 1.0, 1.0]
    assert lrs(4, lr=1.0, lr_warmup_steps=2) == [0.5, 1.0, 1.0, 1.0]
    # warmup from the ratio: 0.25 x 8 = 2 steps; then linear 1.0 -> 0.2 over the remaining 6
    got = lrs(8, lr=1.0, min_lr=0.2, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.25, lr_decay_style="linear")
    want = [0.5, 1.0] + [1.0 - 0.8 * i / 6 for i in range(6)]
    assert got == pytest.approx(want)
    # cosine over 4 steps without warmup: 0.5 * (1 + cos(pi * k / 4))
    got = lrs(4, lr=2.0, lr_warmup_steps=0, lr_decay_style="cosine")
    assert got == pytest.approx([2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 - math.cos(math.pi / 4)])


def test_lr_schedule_errors_name_the_key():
    with pytest.raises(ConfigError, match="lr_decay_style"):
        LRSchedule(OptimConfig(lr_decay_style="step"), 10)
    with pytest.raises(ConfigError, match="total number of optimizer steps"):
        LRSchedule(OptimConfig(lr_decay_style="cosine"), 0)
    with pytest.raises(ConfigError, match="lr_warmup_steps_ratio"):
        LRSchedule(OptimConfig(lr_warmup_steps=-1, lr_warmup_steps_ratio=1.5), 10)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", num_hidden_layers=1)


def tiny(ps, hf_dir, dtype=torch.float32):
    """A 1-layer Llama (megatron GPTModel) with O(1) random weights, and a plain fp32 copy of it."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights

    args = load_model_args(hf_dir)
    models = [build_model(args, ps, "actor", dtype=d) for d in (dtype, torch.float32)]
    for m in models:
        load_hf_weights(m, hf_dir, ps)
    return models


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean log-sum-exp of the logits: a scalar that depends on every weight."""
    from megatron_rl import cpu_bridge
    from megatron_rl.models.forward import causal_padding_mask

    with cpu_bridge.device_mode():
        out = model(ids, None, causal_padding_mask(torch.ones_like(ids)))
    return out.float().logsumexp(-1).mean()


IDS = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(1))


def build(m, ps, **optim):
    from megatron_rl.config import MegatronConfig

    return ModelOptimizer(
        m, OptimConfig(**{"lr_warmup_steps": 0, **optim}), MegatronConfig(), ps, total_steps=6
    )


def test_weight_decay_skips_biases_and_1d_params(ps, hf_dir):
    m, _ = tiny(ps, hf_dir)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = build(m, ps, lr=0.1, weight_decay=0.5)
    opt.zero_grad()  # zero gradients: the Adam term is 0, only decoupled weight decay can move weights
    norm, lr = opt.step()
    assert (norm, lr) == (0.0, 0.1)
    for name, p in m.named_parameters():
        want = before[name] * (1 - 0.1 * 0.5) if p.ndim == 2 else before[name]
        torch.testing.assert_close(p.detach(), want, msg=name)


def test_micro_batches_accumulate_in_ddp_buffers_and_clip(ps, hf_dir):
    """Two backward passes through the DDP module accumulate the gradient of one pass over all rows
    (oracle: plain autograd on an unwrapped copy); the norm and the clipping are megatron's."""
    m, plain = tiny(ps, hf_dir)
    opt = build(m, ps, lr=0.1, clip_grad=0.1)
    opt.zero_grad()
    (loss_of(opt.ddp, IDS[:2]) / 2).backward()
    (loss_of(opt.ddp, IDS[2:]) / 2).backward()
    ((loss_of(plain, IDS[:2]) + loss_of(plain, IDS[2:])) / 2).backward()
    grads = dict(plain.named_parameters())
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.main_grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    flat = torch.cat([p.grad.flatten() for p in plain.parameters()])
    norm, _ = opt.step()
    assert norm == pytest.approx(flat.norm().item(), rel=1e-5)
    assert norm > 0.1
    clipped = torch.cat([p.main_grad.flatten() for p in m.parameters()])
    torch.testing.assert_close(clipped, flat * 0.1 / (norm + 1e-6), rtol=1e-5, atol=1e-7)  # before Adam


def test_non_finite_grad_skips_the_step(ps, hf_dir):
    m, _ = tiny(ps, hf_dir)
    before = [p.detach().clone() for p in m.parameters()]
    opt = build(m, ps)
    opt.zero_grad()
    loss_of(opt.ddp, IDS).backward()
    next(m.parameters()).main_grad[0, 0] = float("inf")
    norm, _ = opt.step()
    assert math.isinf(norm) and opt.num_steps == 0 and opt.skipped_steps == 1
    for p, b in zip(m.parameters(), before, strict=True):
        assert torch.equal(p, b)


def _train(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(opt.ddp, torch.randint(3, 99, (2, 6), generator=g)).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_continues_identically(ps, hf_dir, tmp_path, dtype):
    """Sharded optimizer state through dist_checkpointing (as the trainer's checkpoints hold it)."""
    from megatron_rl.run.checkpoint import load_optimizer, save_optimizer

    cfg = dict(lr=0.05, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=0.01)
    a, _ = tiny(ps, hf_dir, dtype)
    opt_a = build(a, ps, **cfg)
    _train(a, opt_a, 3, seed=1)
    save_optimizer(opt_a, ps, str(tmp_path / "optim"))
    counters = opt_a.counters()
    b, _ = tiny(ps, hf_dir, dtype)
    b.load_state_dict(a.state_dict())
    opt_b = build(b, ps, **cfg)
    load_optimizer(opt_b, str(tmp_path / "optim"))
    opt_b.load_counters(counters)
    assert opt_b.num_steps == 3 and opt_b.lr == opt_a.lr
    _train(a, opt_a, 2, seed=2)
    _train(b, opt_b, 2, seed=2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_low_precision_params_train_through_fp32_masters(ps, hf_dir):
    from megatron_rl.rounding import main_to_model_pairs

    m, _ = tiny(ps, hf_dir, torch.bfloat16)
    opt = build(m, ps, lr=1e-3, weight_decay=0.0, stochastic_rounding=False)  # the copy checked below
    masters = opt.state_tensors()
    assert masters and all(t.dtype == torch.float32 for t in masters)
    opt.zero_grad()
    loss_of(opt.ddp, IDS).backward()
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0 for p in m.parameters())
    (sub,) = opt._sub_optimizers
    pairs = main_to_model_pairs(sub)  # (fp32 main, the bf16 parameter memory it is written to)
    assert sum(view.numel() for _, view in pairs) == sum(p.numel() for p in m.parameters())
    start = [mst.detach().clone() for mst, _ in pairs]
    opt.step()
    for (mst, view), s in zip(pairs, start, strict=True):
        # Adam's first step moves every element with a nonzero gradient by ~lr: visible in fp32 masters
        # (1e-3 is below bf16's resolution near 1, which is why masters exist).
        assert (mst.detach() - s).abs().max().item() == pytest.approx(1e-3, rel=0.01)
        assert torch.equal(view, mst.to(torch.bfloat16))


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    from megatron_rl.rounding import stochastic_round

    lo = torch.tensor(0.02).bfloat16().float()  # a bf16 value; its upper neighbour is one ulp away
    ulp = torch.nextafter(lo.bfloat16(), torch.tensor(1.0).bfloat16()).float() - lo
    x = torch.full((200_000,), (lo + 0.3 * ulp).item())  # 30% of the way up
    gen = torch.Generator().manual_seed(0)
    r = stochastic_round(x, torch.bfloat16, gen).float()
    assert set(r.unique().tolist()) == {lo.item(), (lo + ulp).item()}
    assert r.mean().item() == pytest.approx(x[0].item(), abs=2e-3 * ulp.item())  # mean ~ x: unbiased
    assert (r == lo + ulp).float().mean().item() == pytest.approx(0.3, abs=0.01)
    neg = stochastic_round(-x, torch.bfloat16, torch.Generator().manual_seed(0)).float()
    assert torch.equal(neg, -r)  # sign-magnitude: the same for negative values
    # Negative control: rounding to nearest always gives the lower neighbour, i.e. a biased 0.3 ulp.
    assert torch.equal(x.bfloat16().float(), torch.full_like(x, lo.item()))


@pytest.mark.parametrize("stochastic", [False, True])
def test_small_bf16_updates_reach_the_model_only_with_stochastic_rounding(ps, hf_dir, stochastic):
    """lr 1e-5 is below half a bf16 ulp for most of the O(1) weights. Oracle: the fp32 main weights'
    own movement. Rounded to nearest, the bf16 parameters deliver a small part of it; rounded
    stochastically, all of it on average."""
    from megatron_rl.rounding import main_to_model_pairs

    m, _ = tiny(ps, hf_dir, torch.bfloat16)
    opt = build(m, ps, lr=1e-5, weight_decay=0.0, stochastic_rounding=stochastic)
    (sub,) = opt._sub_optimizers
    pairs = main_to_model_pairs(sub)
    mains0 = torch.cat([main.detach().flatten().clone() for main, _ in pairs])
    params0 = torch.cat([p.detach().float().flatten() for _, p in pairs])
    _train(m, opt, 3, seed=4)
    d_main = torch.cat([main.detach().flatten() for main, _ in pairs]) - mains0
    d_param = torch.cat([p.detach().float().flatten() for _, p in pairs]) - params0
    delivered = ((d_param * d_main.sign()).sum() / d_main.abs().sum()).item()
    frac = opt.pop_update_fraction()
    if stochastic:
        assert delivered == pytest.approx(1.0, abs=0.1) and frac > 0.05
    else:
        assert delivered < 0.5 and frac < 0.05
    assert opt.pop_update_fraction() is None  # the counters were reset


def test_fp16_overflows_back_the_loss_scale_off_and_training_goes_on(ps, hf_dir):
    """fp16 through megatron's dynamic loss scaler, started far too high (2^40): the first updates
    overflow, each is skipped and counted as the scaler's (never as a non-finite failure, so the guard
    does not stop the run), the scale halves until the gradients fit, and the updates then train the
    model (its loss falls). Oracle for the skips: the scale's own arithmetic, 2^40 -> the first scale
    without an overflow, one halving per overflow (hysteresis 1)."""
    from megatron_rl.optim import NonFiniteGuard

    m, _ = tiny(ps, hf_dir, torch.float16)
    opt = build(m, ps, lr=1e-3, weight_decay=0.0, initial_loss_scale=2.0**40, hysteresis=1)
    assert opt.loss_scale == 2.0**40
    guard = NonFiniteGuard(limit=1)  # the strictest guard: one non-finite step would stop the run
    ids = IDS[:2]
    first = loss_of(m, ids).item()
    for step in range(40):
        opt.zero_grad()
        # the schedule's grad_scale_func in training: backward from loss x scale, in fp16
        opt.optimizer.scale_loss(loss_of(opt.ddp, ids)).backward()
        opt.step()
        guard.check({"actor/nonfinite_grad_steps": float(opt.skipped_steps)}, step, lambda: None)
    skips = opt.loss_scale_skips
    assert skips >= 5 and opt.skipped_steps == 0
    assert opt.loss_scale == 2.0 ** (40 - skips)  # one halving per overflow, none since
    assert opt.num_steps == 40 - skips  # the LR schedule advanced only on real updates
    assert loss_of(m, ids).item() < first - 0.1
    assert opt.counters()["loss_scale_skips"] == skips


def test_non_finite_advantages_count_as_a_non_finite_step_whatever_the_optimizer_did():
    """NaN advantages on response tokens (not on padding) make the step a non-finite one, even when
    no update was skipped (an fp16 scaler takes their NaN gradients for an overflow)."""
    from megatron_rl.optim import NONFINITE_ADVANTAGES, NonFiniteError, NonFiniteGuard, count_nonfinite

    adv = torch.tensor([[1.0, float("nan"), float("inf")], [0.5, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert count_nonfinite(adv, mask, None) == 2  # the NaN under the mask's 0 is padding
    guard = NonFiniteGuard(limit=2)
    clean = {"actor/nonfinite_grad_steps": 0.0, NONFINITE_ADVANTAGES: 0.0}
    guard.check(clean, 1, lambda: None)
    guard.check({**clean, NONFINITE_ADVANTAGES: 2.0}, 2, lambda: None)
    with pytest.raises(NonFiniteError, match=r"advantages \(tokens\): 2.*max_nonfinite_steps=2"):
        guard.check({**clean, NONFINITE_ADVANTAGES: 2.0}, 3, lambda: "ckpt")


def test_fp16_overflow_at_the_minimum_scale_is_a_non_finite_step(ps, hf_dir):
    """Negative control: with the floor at the start, the scaler cannot back off, so an overflow
    counts as a non-finite step (trainer.max_nonfinite_steps)."""
    m, _ = tiny(ps, hf_dir, torch.float16)
    opt = build(m, ps, lr=1e-3, initial_loss_scale=2.0**40, min_loss_scale=2.0**40, hysteresis=1)
    opt.zero_grad()
    opt.optimizer.scale_loss(loss_of(opt.ddp, IDS[:2])).backward()
    norm, _ = opt.step()
    assert not math.isfinite(norm) and opt.skipped_steps == 1 and opt.loss_scale_skips == 0


@pytest.mark.parametrize(
    "options,recomputed",
    [
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "mlp"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1), "mlp"),
        (dict(recompute_granularity="selective"), "self_attention.core_attention"),
    ],
    ids=["full-uniform", "full-block", "selective"],
)
def test_activation_recompute_gives_the_same_gradients(ps, hf_dir, options, recomputed):
    """Oracle: the same model without recompute. The recomputed module runs twice per backward (the
    check that recompute is on at all)."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights

    args = load_model_args(hf_dir)
    grads, calls = [], []
    for opts in (TrainingOptions(), TrainingOptions(**options)):
        m = build_model(args, ps, "actor", options=opts)
        load_hf_weights(m, hf_dir, ps)
        m.train()
        calls.append(0)
        m.get_submodule(f"decoder.layers.0.{recomputed}").register_forward_hook(
            lambda *_: calls.__setitem__(-1, calls[-1] + 1)
        )
        loss_of(m, IDS).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.equal(grads[0], grads[1])
    assert calls == [1, 2]


def _batch(n: int) -> RolloutBatch:
    prompts, responses = torch.ones(n, 3, dtype=torch.long), torch.ones(n, 2, dtype=torch.long)
    b = RolloutBatch.from_tokens(
        prompts, torch.ones(n, 3), responses, torch.ones(n, 2), [SeqMeta(str(i)) for i in range(n)]
    )
    b.old_log_probs = b.advantages = b.values = b.returns = torch.zeros(n, 2)
    return b


def _loaded(section):
    """A section as load_config leaves it: its derived keys filled (a response length of 2)."""
    from megatron_rl.config.load import fill_update_defaults

    fill_update_defaults(section, 2)
    return section


def test_update_rejects_batch_sizes_that_do_not_tile():
    # 6 sequences, mini-batch 2 prompts x n=2 = 4 sequences: 6 is not a multiple
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batch_size"):
        update_actor(
            None,
            None,
            PS1,
            _batch(6),
            _loaded(ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)),
            2,
        )
    # micro-batch 3 does not divide the 4 sequences of a mini-batch
    with pytest.raises(ConfigError, match=r"critic\.ppo_micro_batch_size_per_gpu=3"):
        update_critic(
            None,
            None,
            PS1,
            _batch(8),
            _loaded(CriticConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3, ppo_epochs=1)),
            2,
        )
    b = _batch(4)
    b.old_log_probs = None  # allowed for one mini-batch and one epoch only (the update's own forward)
    two_epochs = _loaded(ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2))
    with pytest.raises(ValueError, match="old_log_probs"):
        update_actor(None, None, PS1, b, two_epochs, 2)


def test_checkpoint_without_sharded_optimizer_state_is_refused_in_one_line(tmp_path):
    """A trainer checkpoint written before optimizer states were sharded (actor/ beside an
    mp_rank_*.pt holding the whole optimizer, no actor_optim/) names the keys that resume its weights."""
    import json

    from megatron_rl.run.checkpoint import CheckpointManager

    ckpt = tmp_path / "global_step_4"
    (ckpt / "actor").mkdir(parents=True)
    layout = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "layout": layout}))
    manager = CheckpointManager(str(tmp_path), SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, world_size=1))
    with pytest.raises(RuntimeError) as e:
        manager.load(str(ckpt), {"actor": None}, {"actor": None})
    msg = str(e.value)
    assert "\n" not in msg and "actor_optim/" in msg
    assert f"actor_rollout_ref.model.path={ckpt / 'actor'}" in msg and "trainer.resume_mode=disable" in msg


def test_critic_seq_norm_loss_does_not_depend_on_the_batch_width(ps, hf_dir):
    """critic.loss_agg_mode=seq-mean-token-sum-norm divides by critic.loss_scale_factor (resolved to
    data.max_response_length), not by the batch's padded response width: a DP rank whose longest
    response is shorter, or a critic on ranks of its own holding the whole batch, scales alike."""
    from megatron_rl.config import MegatronConfig
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights

    g = torch.Generator().manual_seed(3)
    n, p, r = 4, 3, 3
    prompts = torch.randint(3, 99, (n, p), generator=g)
    resp_mask = torch.arange(r)[None] < torch.tensor([3, 1, 2, 3])[:, None]
    responses = torch.where(resp_mask, torch.randint(3, 99, (n, r), generator=g), 0)
    values, returns = torch.randn(n, r, generator=g), torch.randn(n, r, generator=g)

    def vf_loss(width: int, scale: float | None) -> float:
        pad = width - r  # the same rows, right-padded to another response width
        resp = torch.nn.functional.pad(responses, (0, pad))
        b = RolloutBatch.from_tokens(
            prompts,
            torch.ones(n, p),
            resp,
            torch.nn.functional.pad(resp_mask, (0, pad)),
            [SeqMeta(str(i)) for i in range(n)],
        )
        b.values, b.returns = (
            torch.nn.functional.pad(x, (0, pad)) * b.response_mask for x in (values, returns)
        )
        critic = build_model(load_model_args(hf_dir), ps, "critic")
        load_hf_weights(critic, hf_dir, ps)
        cfg = CriticConfig(
            ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, ppo_epochs=1,
            loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=scale,
        )  # fmt: skip
        opt = ModelOptimizer(
            critic, OptimConfig(lr=0.0, lr_warmup_steps=0), MegatronConfig(), ps, total_steps=1
        )
        return update_critic(critic, opt, ps, b, cfg, 1)["critic/vf_loss"]

    assert vf_loss(3, 8.0) == pytest.approx(vf_loss(6, 8.0), rel=1e-6)
    # negative control: the batch's own width as the scale (the former fallback) moves with the padding
    assert vf_loss(3, 3.0) == pytest.approx(2 * vf_loss(6, 6.0), rel=1e-6)
    with pytest.raises(ConfigError, match=r"critic\.loss_scale_factor is unset"):  # no fallback is left
        vf_loss(3, None)


def test_resuming_optimizer_state_of_the_other_experts_module_is_refused_in_one_line(ps, tmp_path):
    """GroupedExperts and SequentialMLP write the same weights but lay their optimizer states out
    differently: a checkpoint records which one it holds (one written before grouped experts existed
    held SequentialMLP's), and resuming with the other module is refused naming the key."""
    import json

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.run.checkpoint import CheckpointManager, experts_modules

    args = load_model_args(
        save_random_hf_model(str(tmp_path / "hf"), "qwen3_moe", seed=1, num_hidden_layers=2)
    )
    grouped = build_model(args, ps)
    assert experts_modules({"actor": grouped}) == {"actor": "grouped"}
    sequential = build_model(args, ps, options=TrainingOptions(moe_grouped_gemm=False))
    assert experts_modules({"actor": sequential}) == {"actor": "sequential"}
    ckpt = tmp_path / "run" / "global_step_4"
    for d in ("actor", "actor_optim"):
        (ckpt / d).mkdir(parents=True)
    layout = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "layout": layout}))
    manager = CheckpointManager(str(tmp_path / "run"), ps)
    with pytest.raises(RuntimeError) as e:
        manager.load(str(ckpt), {"actor": grouped}, {"actor": None})
    msg = str(e.value)
    assert "\n" not in msg and "sequential experts" in msg and "moe_grouped_gemm=false" in msg
    layout["experts"] = {"actor": "grouped"}
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "layout": layout}))
    with pytest.raises(Exception) as e:  # past the check: the (empty) checkpoint itself fails to load
        manager.load(str(ckpt), {"actor": grouped}, {"actor": None})
    assert "moe_grouped_gemm" not in str(e.value)
