"""Worker: one full PPO update of an actor and a critic at one TP x PP x DP layout.

The same initial weights (HF directories) and the same global rollout batch (built from a seed) at every
layout. Each data-parallel rank takes its rows of every mini-batch, so that the global mini-batches are
the same sets of sequences as at DP=1. Steps:

1. old log-probs/entropy (compute_log_probs) and values (compute_values) of the initial models; with
   --hf-oracle rank 0 checks the log-probs against the HF model's full-vocabulary log_softmax (and a
   misaligned variant as the negative control);
2. update_actor and update_critic (2 epochs x 2 mini-batches: 4 optimizer steps each);
3. direction check: a second, on-policy update with per-sequence advantages of +-1, then log-probs again.

With --lora both models train LoRA adapters (rank 4, alpha 8, seeded by their global names: the same
at every layout) on a frozen base, and the weights written are the merged ones (W + scale B A).

--save-actor writes the updated actor's torch_dist checkpoint to --out/NAME/actor_ckpt; --load-actor RUN
loads RUN/NAME/actor_ckpt (another layout's) into a fresh actor of this layout, whose weights go to the
weights file as "loaded".

With --packed every pass runs each micro-batch packed into one row (use_remove_padding).

With --max-tokens every pass forms its micro-batches by that token budget (use_dynamic_bsz) and every
rank writes the processed tokens of each micro-batch of each pass to plan_pp{P}_tp{T}_dp{D}.json.

Several actor/critic pairs run one after another in one launch (``--models NAME=ACTOR,CRITIC ...``).
Outputs in --out/NAME: result.json (rank 0: metrics, gathered log-probs/values, checks) and, from every
TP-rank-0 process, weights_pp{P}_dp{D}.pt: this stage's updated weights in HF names (TP shards
gathered and scattered back through weights.tables / hf_io.scatter_shard) and the largest difference
between the TP ranks' copies of any replicated parameter.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig
from megatron_rl.config.load import fill_update_defaults
from megatron_rl.config.lora import LoraConfig
from megatron_rl.microbatches import MicroBatching, TokenStats
from megatron_rl.model_args import DTYPES, load_model_args
from megatron_rl.models.builder import (
    TrainingOptions,
    build_model,
    load_hf_weights,
    named_global_params,
    stage_layouts,
)
from megatron_rl.models.chunks import last_chunk
from megatron_rl.models.lora import add_adapters, merged_params
from megatron_rl.optim import LRSchedule, ModelOptimizer
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.ppo import compute_log_probs, compute_values, update_actor, update_critic
from megatron_rl.weights.ckpt_write import save_torch_dist
from megatron_rl.weights.hf_io import scatter_shard
from megatron_rl.weights.tables import hf_shapes
from megatron_rl.weights.torch_dist import load_torch_dist

N_PROMPTS, ROLLOUT_N, P, R = 8, 2, 6, 5
MINI_PROMPTS = 4  # ppo_mini_batch_size: 2 mini-batches of 8 sequences
TEMPERATURE = 2.0
LOGPROB_MICRO = 3  # does not divide the batch: exercises the padded last micro-batch
# Adam's eps: an element whose gradient is at fp32-cancellation level (~1e-7 here, e.g. an embedding row
# whose only uses sit in clipped value-loss terms) would take lr-sized steps of random sign with eps
# 1e-8, which no layout can reproduce; 1e-6 keeps such steps small without touching real gradients.
EPS = 1e-6


def global_batch(vocab: int, seed: int = 0) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """16 sequences: left-padded prompts (shared by the 2 samples of a prompt), responses of 1..5 tokens."""
    g = torch.Generator().manual_seed(seed)
    b = N_PROMPTS * ROLLOUT_N
    prompt_len = torch.randint(2, P + 1, (N_PROMPTS,), generator=g).repeat_interleave(ROLLOUT_N)
    prompt_tok = torch.randint(3, vocab, (N_PROMPTS, P), generator=g).repeat_interleave(ROLLOUT_N, 0)
    pos = torch.arange(P)
    prompt_mask = pos[None] >= (P - prompt_len[:, None])
    prompts = torch.where(prompt_mask, prompt_tok, 0)
    resp_len = torch.tensor([5, 1, 3, 4, 2, 5, 5, 1, 2, 3, 4, 5, 1, 3, 5, 2])
    resp_mask = torch.arange(R)[None] < resp_len[:, None]
    responses = torch.where(resp_mask, torch.randint(3, vocab, (b, R), generator=g), 0)
    meta = [SeqMeta(uid=str(i // ROLLOUT_N)) for i in range(b)]
    batch = RolloutBatch.from_tokens(prompts, prompt_mask, responses, resp_mask, meta)
    mask = batch.response_mask
    extra = {
        "old_noise": torch.randn(b, R, generator=g) * 0.3,
        "ref_noise": torch.randn(b, R, generator=g) * 0.3,
        "advantages": torch.randn(b, R, generator=g) * mask,
        "value_noise": torch.randn(b, R, generator=g) * 0.5,
        "return_noise": torch.randn(b, R, generator=g),
        "signs": torch.tensor([1.0, -1.0]).repeat(b // 2)[torch.randperm(b, generator=g)],
        # rollout importance weights (the mismatch correction), in the range truncation leaves
        "is_weights": (0.5 + 1.5 * torch.rand(b, R, generator=g)) * mask,
    }
    # Tokens the policy now prefers strongly (ratio e^1.5 > clip_ratio_c) with negative advantages:
    # dual-clip is active on them.
    extra["old_noise"][:4, 0] = -1.5
    extra["advantages"][:4, 0] = -extra["advantages"][:4, 0].abs() - 0.5
    return batch, extra


def dp_rows(dp_rank: int, dp_size: int) -> list[int]:
    """This DP rank's rows: its 1/DP part of every global mini-batch, in mini-batch order."""
    m = MINI_PROMPTS * ROLLOUT_N
    per = m // dp_size
    return [j * m + dp_rank * per + i for j in range(N_PROMPTS * ROLLOUT_N // m) for i in range(per)]


def gather_dp(x: torch.Tensor, ps) -> torch.Tensor:
    """Local rows [B/DP, ...] -> the global batch order [B, ...] on every rank."""
    if ps.dp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps.dp_size)]
    dist.all_gather(parts, x.contiguous(), group=ps.dp_group)
    out = torch.empty((x.shape[0] * ps.dp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        out[dp_rows(r, ps.dp_size)] = part
    return out


def hf_named_weights(model, ps, role: str) -> tuple[dict[str, torch.Tensor], float]:
    """This stage's parameters in HF names (on TP rank 0) and the largest |padded vocab row|."""
    args = model.args
    params = merged_params(model, named_global_params(model))  # LoRA: W + scale * B @ A
    shapes = hf_shapes(args)
    out: dict[str, torch.Tensor] = {}
    padded_max = 0.0
    for lay in stage_layouts(model, ps):
        shard = params[lay.name].detach()
        shards = [torch.empty_like(shard) for _ in range(ps.tp_size)]
        dist.all_gather(shards, shard.contiguous(), group=ps.tp_group)
        shards = [sh.float().cpu() for sh in shards]
        for name in {pc.hf_name for rank in lay.pieces for pc in rank}:
            out.setdefault(name, torch.zeros(shapes[name]))
        for r, sh in enumerate(shards):
            scatter_shard(lay, r, sh, out)
            real = sum(pc.stop - pc.start for pc in lay.pieces[r])
            if lay.dim == 0 and real < sh.shape[0]:
                padded_max = max(padded_max, sh[real:].abs().max().item())
    if role == "critic" and ps.is_last_stage:
        head = last_chunk(model).output_layer
        out["value_head.weight"] = head.weight.detach().float().cpu()
        out["value_head.bias"] = head.bias.detach().float().cpu()
    return out, padded_max


def hf_oracle(path: str, batch: RolloutBatch, lp: torch.Tensor, ent: torch.Tensor) -> dict[str, float]:
    """Compare log-probs/entropy with the HF model's log_softmax over the full vocabulary."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / TEMPERATURE
    real = batch.response_mask.bool()

    def at(shift: int):
        logp_all = torch.log_softmax(logits[:, P - 1 + shift : P + R - 1 + shift].double(), -1)
        return logp_all.gather(-1, batch.responses[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(
            -1
        )

    ref_lp, ref_ent = at(0)
    wrong_lp = torch.log_softmax(logits[:, P : P + R].double(), -1).gather(-1, batch.responses[..., None])[
        ..., 0
    ]
    return {
        "hf_logp_max_diff": (lp.double() - ref_lp)[real].abs().max().item(),
        "hf_entropy_max_diff": (ent.double() - ref_ent)[real].abs().max().item(),
        "hf_misaligned_diff": (lp.double() - wrong_lp)[real].abs().max().item(),
        "max_abs_logp": ref_lp[real].abs().max().item(),
    }


def tp_replica_diff(model, ps) -> float:
    """Largest difference between TP ranks' copies of any TP-replicated parameter (norms, q/k norms,
    biases of row-parallel layers, the value head): 0 when every copy received the same update."""
    diff = 0.0
    for p in model.parameters():
        if ps.tp_size == 1 or getattr(p, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(p) for _ in range(ps.tp_size)]
        dist.all_gather(copies, p.detach().contiguous(), group=ps.tp_group)
        diff = max(diff, max((c - copies[0]).abs().max().item() for c in copies))
    return diff


def break_qk_norm_reduction(model) -> None:
    """Negative control: drop the TP sum of the q/k-norm gradients (finalize_model_grads sums them for
    qk_layernorm, and for weights marked sequence_parallel)."""
    model.config.qk_layernorm = False
    for name, p in model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            p.sequence_parallel = False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--models", nargs="+", required=True, help="NAME=ACTOR_DIR,CRITIC_DIR pairs, run one after another"
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline stage (interleaved)")
    ap.add_argument("--micro", type=int, required=True, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-oracle", action="store_true", help="check log-probs against the HF model (rank 0)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", help="parameter dtype: float32 | bfloat16")
    ap.add_argument("--no-sequence-parallel", action="store_true")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--break-qk-norm-reduction", action="store_true", help="negative control")
    ap.add_argument("--max-tokens", type=int, default=None, help="token budget per micro-batch (dynamic)")
    ap.add_argument("--lora", action="store_true", help="LoRA adapters (rank 4) on actor and critic")
    ap.add_argument("--packed", action="store_true", help="every pass packed (use_remove_padding)")
    ap.add_argument("--save-actor", action="store_true", help="the updated actor's checkpoint")
    ap.add_argument("--load-actor", default=None, help="a run's --out: load its actor checkpoints")
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, seed=1, device=a.device)
    for spec in a.models:
        name, paths = spec.split("=")
        actor_dir, critic_dir = paths.split(",")
        out = os.path.join(a.out, name)
        if ps.rank == 0:
            os.makedirs(out, exist_ok=True)
        dist.barrier()
        run_pair(ps, a, actor_dir, critic_dir, out)
    destroy_parallel()


def run_pair(ps, a, actor_dir: str, critic_dir: str, out_dir: str) -> None:
    """Steps 1-3 of the module docstring for one actor/critic pair; results into ``out_dir``."""
    dtype = DTYPES[a.dtype]
    options = TrainingOptions(
        sequence_parallel=not a.no_sequence_parallel,
        virtual_pipeline=a.vpp,
        lora=a.lora,
        packed_sequences=a.packed,
    )

    def adapt(model, key: str, path: str) -> None:
        if a.lora:
            add_adapters(model, LoraConfig(rank=4, alpha=8.0), ps, key, path, seed=3)

    mcfg = MegatronConfig(use_distributed_optimizer=not a.no_distributed_optimizer)
    actor_args, critic_args = load_model_args(actor_dir), load_model_args(critic_dir)
    full, extra = global_batch(actor_args.vocab_size)
    rows = dp_rows(ps.dp_rank, ps.dp_size)
    batch = full.select(rows).to(ps.device)
    ex = {k: v[rows].to(ps.device) for k, v in extra.items()}
    mask = batch.response_mask
    res: dict = {"layout": {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size}}
    dynamic = a.max_tokens is not None
    tokens = TokenStats()

    def forward_micro(size: int) -> MicroBatching:
        return MicroBatching.of(size, dynamic, a.max_tokens, "--max-tokens")

    budget = {"use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": a.max_tokens or 1}

    # ---- actor ----
    actor = build_model(actor_args, ps, "actor", dtype=dtype, options=options)
    load_hf_weights(actor, actor_dir, ps)
    adapt(actor, "actor_rollout_ref.model.lora", actor_dir)
    if a.break_qk_norm_reduction:
        break_qk_norm_reduction(actor)
    lp, ent = compute_log_probs(
        actor, ps, batch, forward_micro(LOGPROB_MICRO), TEMPERATURE, with_entropy=True, stats=tokens
    )
    lp_only = compute_log_probs(actor, ps, batch, forward_micro(4), TEMPERATURE)
    res["logp_only_vs_with_entropy"] = (lp_only - lp).abs().max().item()
    glp, gent = gather_dp(lp, ps), gather_dp(ent, ps)
    res["logp"], res["entropy"] = glp.tolist(), gent.tolist()
    if a.hf_oracle and ps.rank == 0:
        res.update(hf_oracle(actor_dir, full, glp.cpu(), gent.cpu()))

    batch.old_log_probs = (lp + ex["old_noise"]) * mask
    batch.ref_log_probs = (lp + ex["ref_noise"]) * mask
    batch.advantages = ex["advantages"]
    batch.rollout_is_weights = ex["is_weights"]
    actor_cfg = ActorConfig(
        ppo_mini_batch_size=MINI_PROMPTS,
        ppo_micro_batch_size_per_gpu=a.micro,
        **budget,
        ppo_epochs=2,
        clip_ratio=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        # per-sequence token sums over a constant (Dr. GRPO): the denominator counts sequences over DP
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=float(batch.response_length),  # a constant, whatever the micro-batches
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl+",
        optim=OptimConfig(
            lr=2e-3,
            min_lr=2e-4,
            lr_warmup_steps=1,
            lr_decay_style="cosine",
            weight_decay=0.01,
            clip_grad=1.0,
            eps=EPS,
        ),
    )
    fill_update_defaults(actor_cfg, batch.response_length)
    opt = ModelOptimizer(actor, actor_cfg.optim, mcfg, ps, total_steps=4)
    res["actor"] = update_actor(actor, opt, ps, batch, actor_cfg, ROLLOUT_N, TEMPERATURE, stats=tokens)
    res["actor_steps"] = opt.num_steps
    actor_w, padded_max = hf_named_weights(actor, ps, "actor")
    if a.save_actor:
        save_torch_dist(actor, ps, os.path.join(out_dir, "actor_ckpt"))
    loaded_w = None
    if a.load_actor:  # the base from its HF directory, the rest (LoRA: the adapters) from the checkpoint
        fresh = build_model(actor_args, ps, "actor", dtype=dtype, options=options)
        load_hf_weights(fresh, actor_dir, ps)
        adapt(fresh, "actor_rollout_ref.model.lora", actor_dir)
        load_torch_dist(fresh, ps, os.path.join(a.load_actor, os.path.basename(out_dir), "actor_ckpt"))
        loaded_w, _ = hf_named_weights(fresh, ps, "actor")

    # ---- critic ----
    critic = build_model(critic_args, ps, "critic", dtype=dtype, options=options)
    load_hf_weights(critic, critic_dir, ps)
    if ps.is_last_stage:  # a random value head, the same on every layout (zeros would block trunk grads)
        g = torch.Generator().manual_seed(7)
        h = critic_args.hidden_size
        with torch.no_grad():
            last_chunk(critic).output_layer.weight.copy_(torch.randn(1, h, generator=g) / h**0.5)
            last_chunk(critic).output_layer.bias.copy_(torch.randn(1, generator=g))
    adapt(critic, "critic.model.lora", critic_dir)
    values = compute_values(critic, ps, batch, forward_micro(LOGPROB_MICRO), stats=tokens)
    res["values"] = gather_dp(values, ps).tolist()
    batch.values = (values + ex["value_noise"]) * mask
    batch.returns = (batch.values + ex["return_noise"]) * mask
    critic_cfg = CriticConfig(
        ppo_mini_batch_size=MINI_PROMPTS,
        ppo_micro_batch_size_per_gpu=a.micro,
        **budget,
        ppo_epochs=2,
        cliprange_value=0.5,
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=float(batch.response_length),
        optim=OptimConfig(
            lr=2e-3,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_style="linear",
            weight_decay=0.01,
            clip_grad=1.0,
            eps=EPS,
        ),
    )
    copt = ModelOptimizer(critic, critic_cfg.optim, mcfg, ps, total_steps=4)
    res["critic"] = update_critic(critic, copt, ps, batch, critic_cfg, ROLLOUT_N, stats=tokens)
    critic_w, _ = hf_named_weights(critic, ps, "critic")
    replica_diff = max(tp_replica_diff(actor, ps), tp_replica_diff(critic, ps))

    # ---- direction: an on-policy update with per-sequence advantages +-1 ----
    lp_now = compute_log_probs(actor, ps, batch, forward_micro(LOGPROB_MICRO), TEMPERATURE)
    adv = ex["signs"][:, None] * mask
    batch.old_log_probs, batch.advantages, batch.rollout_is_weights = lp_now, adv, None
    dir_cfg = ActorConfig(
        ppo_mini_batch_size=N_PROMPTS,
        ppo_micro_batch_size_per_gpu=a.micro,
        **budget,
        ppo_epochs=1,
        clip_ratio=0.2,
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0, clip_grad=0.0),
    )
    fill_update_defaults(dir_cfg, batch.response_length)
    # One DDP per model: the same optimizer continues, with this update's schedule and no clipping.
    opt.cfg, opt.schedule, opt.num_steps = dir_cfg.optim, LRSchedule(dir_cfg.optim, 1), 0
    update_actor(
        actor,
        opt,
        ps,
        batch,
        dir_cfg,
        ROLLOUT_N,
        TEMPERATURE,
    )
    delta = gather_dp(
        compute_log_probs(actor, ps, batch, forward_micro(LOGPROB_MICRO), TEMPERATURE) - lp_now, ps
    )
    gadv, gmask = gather_dp(adv, ps), gather_dp(mask, ps).bool()
    pos, neg = (gadv > 0) & gmask, (gadv < 0) & gmask
    res["direction"] = {
        "mean_delta_pos": delta[pos].mean().item(),
        "mean_delta_neg": delta[neg].mean().item(),
        "frac_right_direction": ((delta * gadv)[gmask] > 0).float().mean().item(),
        "n_pos": int(pos.sum()),
        "n_neg": int(neg.sum()),
    }

    if ps.tp_rank == 0:
        torch.save(
            {
                "actor": actor_w,
                "critic": critic_w,
                "loaded": loaded_w,
                "padded_max": padded_max,
                "replica_diff": replica_diff,
            },
            os.path.join(out_dir, f"weights_pp{ps.pp_rank}_dp{ps.dp_rank}.pt"),
        )
    if ps.rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(res, f)
    if dynamic:  # old log-probs, update_actor's 4 mini-batches, values, update_critic's 4
        name = f"plan_pp{ps.pp_rank}_tp{ps.tp_rank}_dp{ps.dp_rank}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(
                {"micro_batch_tokens": tokens.micro_batch_tokens, "padding": tokens.padding_fraction()}, f
            )
    dist.barrier()


if __name__ == "__main__":
    main()
