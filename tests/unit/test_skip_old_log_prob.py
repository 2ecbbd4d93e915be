"""Skipping the old-log-prob pass: the actor update with ``batch.old_log_probs = None`` equals, bit for
bit (CPU, fp32), the update after compute_log_probs, when one mini-batch and one epoch cover the batch.

A tiny megatron GPTModel (1 layer, O(1) random weights) is updated once by each path from the same
initial weights; the metrics, every updated weight and the old log-probs stored back on the batch must
be identical. Negative control: old log-probs off by 1e-6 on one token change the metrics. The
predicate ``old_log_prob_is_first_forward`` is checked key by key against a config where it holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import ActorConfig, MegatronConfig, OptimConfig, load_config, resolve
from megatron_rl.config.load import fill_update_defaults
from megatron_rl.microbatches import ForwardPasses, MicroBatching
from megatron_rl.ppo import compute_log_probs, update_actor
from megatron_rl.roles.actor import old_log_prob_is_first_forward

N_PROMPTS, ROLLOUT_N, P, R = 4, 2, 4, 5
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2", num_hidden_layers=1)


def make_batch(vocab: int) -> RolloutBatch:
    """8 sequences: left-padded prompts of 2..4 tokens, responses of 1..5 tokens, random advantages."""
    g = torch.Generator().manual_seed(0)
    n = N_PROMPTS * ROLLOUT_N
    prompt_len = torch.tensor([2, 4, 3, 4]).repeat_interleave(ROLLOUT_N)
    prompt_mask = torch.arange(P)[None] >= (P - prompt_len[:, None])
    prompts = torch.where(prompt_mask, torch.randint(3, vocab, (n, P), generator=g), 0)
    resp_len = torch.tensor([5, 1, 3, 4, 2, 5, 4, 3])
    resp_mask = torch.arange(R)[None] < resp_len[:, None]
    responses = torch.where(resp_mask, torch.randint(3, vocab, (n, R), generator=g), 0)
    meta = [SeqMeta(uid=str(i // ROLLOUT_N)) for i in range(n)]
    batch = RolloutBatch.from_tokens(prompts, prompt_mask, responses, resp_mask, meta)
    batch.advantages = torch.randn(n, R, generator=g) * batch.response_mask
    return batch


def actor_cfg(**kw) -> ActorConfig:
    # one mini-batch of all 8 sequences, micro-batches of 2 (gradient accumulation over 4)
    base = dict(ppo_mini_batch_size=N_PROMPTS, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01)
    cfg = ActorConfig(**{**base, **kw})
    fill_update_defaults(cfg, R)
    return cfg


def update_once(
    ps, hf_dir, batch: RolloutBatch, cfg: ActorConfig, run_pass: bool = False
) -> tuple[dict, dict]:
    """A fresh model from ``hf_dir`` updated once on ``batch`` (``run_pass``: after computing the old
    log-probs with the update's micro-batching): (metrics, updated weights)."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.optim import ModelOptimizer

    model = build_model(load_model_args(hf_dir), ps, "actor", dtype=torch.float32)
    load_hf_weights(model, hf_dir, ps)
    opt = ModelOptimizer(model, OptimConfig(lr=1e-2, lr_warmup_steps=0), MegatronConfig(), ps, total_steps=1)
    if run_pass:
        micro = MicroBatching.of(
            cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu, "k"
        )
        batch.old_log_probs = compute_log_probs(model, ps, batch, micro, TEMPERATURE)
    metrics = update_actor(model, opt, ps, batch, cfg, ROLLOUT_N, TEMPERATURE)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def both_paths(ps, hf_dir, cfg: ActorConfig):
    vocab = 99
    with_pass, skipped = make_batch(vocab), make_batch(vocab)
    ran = update_once(ps, hf_dir, with_pass, cfg, run_pass=True)
    assert skipped.old_log_probs is None
    skip = update_once(ps, hf_dir, skipped, cfg)
    return (with_pass, ran), (skipped, skip)


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_skipped_pass_gives_the_same_update_bit_for_bit(ps, hf_dir, dynamic):
    # dynamic: token-budget micro-batches, each row compacted (the response mask comes from the index)
    cfg = actor_cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20) if dynamic else actor_cfg()
    (with_pass, (m_pass, w_pass)), (skipped, (m_skip, w_skip)) = both_paths(ps, hf_dir, cfg)
    assert m_skip == m_pass  # every metric, exactly
    assert m_pass["actor/ppo_kl"] == 0.0 and m_pass["actor/pg_clipfrac"] == 0.0  # on-policy: ratio 1
    assert m_pass["actor/grad_norm"] > 0
    for name, w in w_pass.items():
        assert torch.equal(w_skip[name], w), name
    # the old log-probs stored back are compute_log_probs' values: bitwise, 0 past each response
    assert torch.equal(skipped.old_log_probs, with_pass.old_log_probs)
    real = with_pass.attention_mask[:, -R:].bool()
    assert (with_pass.old_log_probs[real] < 0).all() and (with_pass.old_log_probs[~real] == 0).all()


def test_negative_control_old_log_probs_off_by_a_rounding_step_change_the_update(ps, hf_dir):
    cfg = actor_cfg()
    (with_pass, (m_pass, _)), _ = both_paths(ps, hf_dir, cfg)
    off = make_batch(99)
    off.old_log_probs = with_pass.old_log_probs.clone()
    off.old_log_probs[0, 2] += 1e-6
    m_off, _ = update_once(ps, hf_dir, off, cfg)
    assert m_off["actor/ppo_kl"] != m_pass["actor/ppo_kl"]


def test_entropy_loss_is_logged_only_when_it_is_a_loss_term(ps, hf_dir):
    """verl's actor/entropy_loss names the entropy bonus; at entropy_coeff=0 only actor/entropy (the
    measured entropy) is logged, and it is the same value either way."""
    with_bonus, _ = update_once(ps, hf_dir, make_batch(99), actor_cfg())
    without, _ = update_once(ps, hf_dir, make_batch(99), actor_cfg(entropy_coeff=0.0))
    assert with_bonus["actor/entropy_loss"] == with_bonus["actor/entropy"]
    assert "actor/entropy_loss" not in without and without["actor/entropy"] == with_bonus["actor/entropy"]


def test_update_refuses_a_missing_old_log_prob_pass_with_several_mini_batches(ps, hf_dir):
    batch = make_batch(99)
    with pytest.raises(ValueError, match="2 mini-batches"):
        update_once(ps, hf_dir, batch, actor_cfg(ppo_mini_batch_size=2))
    with pytest.raises(ValueError, match="ppo_epochs=2"):
        update_once(ps, hf_dir, batch, actor_cfg(ppo_epochs=2))


# --------------------------------------------------------------------------------------------------
# The predicate
# --------------------------------------------------------------------------------------------------

# 4 prompts x n=2 over DP=2: 4 sequences per rank, one mini-batch; both passes micro-batches of 2.
HOLDS = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.model.path=/models/x",
]


def holds(*overrides: str, batch_size: int = 4, step: int = 1, model=None) -> bool:
    cfg = load_config(None, [*HOLDS, *overrides])
    spec = resolve(cfg, "cpu").actor
    passes = ForwardPasses.from_config(cfg)
    return old_log_prob_is_first_forward(
        cfg.actor_rollout_ref.actor, spec, passes, batch_size, 2, step, model
    )


def test_predicate_holds_for_one_on_policy_update():
    assert holds()
    dyn = "actor_rollout_ref.actor.use_dynamic_bsz=true"
    assert holds(dyn)  # the old-log-prob pass inherits the same token budget
    # different micro-batch sizes are irrelevant under dynamic batching, the token budget is not
    assert holds(dyn, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4")
    assert not holds(dyn, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1000")


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # two mini-batches
        "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "trainer.critic_warmup=1",  # step 1 does not update the actor
    ],
)
def test_predicate_fails_when_the_pass_is_needed(override):
    assert holds()
    assert not holds(override)


def test_predicate_reads_the_model_config_when_given():
    class Model:
        config = dataclasses.make_dataclass("C", [("hidden_dropout", float), ("attention_dropout", float)])(
            0.0, 0.0
        )

    assert holds(model=Model())
    Model.config.attention_dropout = 0.1
    assert not holds(model=Model())
    assert not holds(batch_size=8)  # this rank's batch is two mini-batches


def test_the_actor_role_skips_the_pass_exactly_when_the_predicate_holds(ps, hf_dir):
    """The loop's call (ActorRole.log_probs) follows the predicate: None (the update fills them) when it
    holds, the pass's log-probs otherwise; timing_s/old_log_prob is logged either way."""
    from megatron_rl.microbatches import TokenStats
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.roles.actor import ActorRole
    from megatron_rl.run.metrics import Timer

    model = build_model(load_model_args(hf_dir), ps, "actor", dtype=torch.float32)
    load_hf_weights(model, hf_dir, ps)
    # DP = 1 here: 4 prompts x n = 2 are this rank's 8 sequences, one mini-batch of them
    for extra, skipped in (
        ([], True),
        (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"], False),
    ):
        cfg = load_config(None, [*HOLDS, *extra])
        timer = Timer(ps.device)
        spec, passes = resolve(cfg, "cpu").actor, ForwardPasses.from_config(cfg)
        correction = cfg.algorithm.rollout_correction
        role = ActorRole(cfg.actor_rollout_ref.actor, correction, spec, ps, model, None, passes, timer)
        batch = make_batch(99)
        lp = role.log_probs(1, batch, TokenStats())
        assert (lp is None) == skipped
        if not skipped:
            assert lp.shape == batch.response_mask.shape and (lp[batch.response_mask.bool()] < 0).all()
        assert "timing_s/old_log_prob" in timer.pop()
