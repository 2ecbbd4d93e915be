"""The optimizer (LR schedule, weight-decay groups, clipping, gradient buckets, fp32 masters, checkpoints)
and the PPO update's batch-size checks, in one process (DP = TP = PP = 1: no collectives).

The distributed parts (DP average, tied-embedding sum, TP/PP grad norm) are checked against an
unsharded run in tests/distributed/test_ppo_layouts.py.
"""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import ActorConfig, ConfigError, CriticConfig, OptimConfig
from megatron_rl.optim import LRSchedule, build_optimizer
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


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2).to(dtype)
        self.norm = nn.LayerNorm(2).to(dtype)

    def forward(self, x):
        return self.norm(self.lin(x))


def test_weight_decay_skips_biases_and_1d_params():
    m = Tiny()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = build_optimizer(m, OptimConfig(lr=0.1, weight_decay=0.5, lr_warmup_steps=0), PS1, total_steps=1)
    opt.zero_grad()  # zero gradients: the Adam term is 0, only decoupled weight decay can move weights
    norm, lr = opt.step()
    assert (norm, lr) == (0.0, 0.1)
    torch.testing.assert_close(m.lin.weight, before["lin.weight"] * (1 - 0.1 * 0.5))
    for name in ("lin.bias", "norm.weight", "norm.bias"):
        assert torch.equal(dict(m.named_parameters())[name], before[name]), name


def test_micro_batches_accumulate_into_the_buckets_and_clip():
    m = Tiny()
    opt = build_optimizer(m, OptimConfig(lr=0.1, clip_grad=1.0, lr_warmup_steps=0), PS1, total_steps=1)
    opt.zero_grad()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    (m(x[:2]) ** 2).sum().backward()
    (m(x[2:]) ** 2).sum().backward()
    ref = Tiny()
    (ref(x) ** 2).sum().backward()  # one pass over all rows: the accumulated gradient
    flat = torch.cat([p.grad.flatten() for p in ref.parameters()])
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert sum(b.numel() for b in opt.buckets) == flat.numel()
    norm, _ = opt.step()
    assert norm == pytest.approx(flat.norm().item(), rel=1e-6)
    assert norm > 1.0
    clipped = torch.cat([p.grad.flatten() for p in m.parameters()])
    torch.testing.assert_close(clipped, flat / (norm + 1e-6))  # clipped in place before AdamW


def test_set_to_none_is_detected():
    m = Tiny()
    opt = build_optimizer(m, OptimConfig(lr_warmup_steps=0), PS1, total_steps=1)
    m.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"ModelOptimizer\.zero_grad\(\)"):
        opt.step()


def test_non_finite_grad_skips_the_step():
    m = Tiny()
    before = [p.detach().clone() for p in m.parameters()]
    opt = build_optimizer(m, OptimConfig(lr_warmup_steps=0), PS1, total_steps=1)
    opt.zero_grad()
    m.lin.weight.grad[0, 0] = float("inf")
    norm, _ = opt.step()
    assert math.isinf(norm) and opt.num_steps == 0 and opt.skipped_steps == 1
    for p, b in zip(m.parameters(), before, strict=True):
        assert torch.equal(p, b)


def _train(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        (m(torch.randn(4, 3, generator=g).to(m.lin.weight.dtype)).float() ** 2).sum().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(dtype):
    cfg = OptimConfig(lr=0.05, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=0.01)
    a = Tiny(dtype)
    opt_a = build_optimizer(a, cfg, PS1, total_steps=6)
    _train(a, opt_a, 3, seed=1)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)  # as a checkpoint would
    buf.seek(0)
    sd = torch.load(buf)
    b = Tiny(dtype)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, cfg, PS1, total_steps=6)
    opt_b.load_state_dict(sd)
    assert opt_b.num_steps == 3 and opt_b.lr == opt_a.lr
    _train(a, opt_a, 2, seed=2)
    _train(b, opt_b, 2, seed=2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_low_precision_params_train_through_fp32_masters():
    m = Tiny(torch.bfloat16)
    opt = build_optimizer(m, OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0), PS1, total_steps=1)
    assert all(mst.dtype == torch.float32 for mst in opt.masters)
    opt.zero_grad()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).bfloat16()
    (m(x[:2]).float() ** 2).sum().backward()
    (m(x[2:]).float() ** 2).sum().backward()
    assert all(p.grad is None for p in m.parameters())  # moved into the fp32 bucket by the hook
    assert all(mst.grad.dtype == torch.float32 and mst.grad.abs().sum() > 0 for mst in opt.masters)
    start = [mst.detach().clone() for mst in opt.masters]
    opt.step()
    for p, mst, s in zip(m.parameters(), opt.masters, start, strict=True):
        # Adam's first step moves every element with a nonzero gradient by ~lr: visible in fp32 masters
        # (1e-3 is below bf16's resolution near 1, which is why masters exist).
        assert (mst.detach() - s).abs().max().item() == pytest.approx(1e-3, rel=0.01)
        assert torch.equal(p, mst.to(torch.bfloat16))
    # A second optimizer over the same model takes the gradients over; the first one notices.
    opt2 = build_optimizer(m, OptimConfig(lr=1e-3, lr_warmup_steps=0), PS1, total_steps=1)
    _train(m, opt2, 1, seed=3)
    assert opt2.num_steps == 1
    with pytest.raises(RuntimeError, match="another optimizer"):
        opt.step()


def _batch(n: int) -> RolloutBatch:
    prompts, responses = torch.ones(n, 3, dtype=torch.long), torch.ones(n, 2, dtype=torch.long)
    b = RolloutBatch.from_tokens(
        prompts, torch.ones(n, 3), responses, torch.ones(n, 2), [SeqMeta(str(i)) for i in range(n)]
    )
    b.old_log_probs = b.advantages = b.values = b.returns = torch.zeros(n, 2)
    return b


def test_update_rejects_batch_sizes_that_do_not_tile():
    # 6 sequences, mini-batch 2 prompts x n=2 = 4 sequences: 6 is not a multiple
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batch_size"):
        update_actor(
            None, None, PS1, _batch(6), ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2), 2
        )
    # micro-batch 3 does not divide the 4 sequences of a mini-batch
    with pytest.raises(ConfigError, match=r"critic\.ppo_micro_batch_size_per_gpu=3"):
        update_critic(
            None,
            None,
            PS1,
            _batch(8),
            CriticConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3, ppo_epochs=1),
            2,
        )
    b = _batch(4)
    b.old_log_probs = None
    with pytest.raises(ValueError, match="old_log_probs"):
        update_actor(
            None, None, PS1, b, ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2), 2
        )
