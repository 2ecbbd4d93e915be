"""Worker: routing replay (R3) of a Qwen3-MoE actor (with a dense layer) against the transformers engine.

Every rank: build the actor at the given layout with replay on its routers, stream it into the engine,
generate greedily with return_routed_experts (varied prompt and response lengths), assemble the
RolloutBatch, then:
  * the recorded routing: -1 on the dense layer, the padding and each row's last token; equal to the
    top-k of one full HF forward of the whole sequence (independent of the KV-cached decode);
  * replayed log-probs (fixed and token-budget micro-batches) against the engine's own log-probs,
    and the share of (token, layer) pairs whose own top-k differs from the engine's (0 in fp32: the
    trainer's routers would choose the same);
  * negative control: the routing shifted by one position: the shares differ and the log-probs move;
  * R2: the routing recorded in a forward-only pass (fixed and token-budget micro-batches), back in the
    batch's layout: equal to the full HF forward's top-k on every real token (the last one too), -1 on
    padding and the dense layer;
  * routers perturbed (noise on every router weight): without replay the routing differs from the
    engine's; with replay (the engine's, R3, or the unperturbed pass's, R2) every router used exactly
    the recorded experts.

Rank 0 writes the records of all ranks to --out.
"""

import argparse
import json

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import RolloutConfig
from megatron_rl.data import PromptItem
from megatron_rl.microbatches import MicroBatching
from megatron_rl.model_args import load_model_args
from megatron_rl.models import routing
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
from megatron_rl.models.chunks import chunks_of
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.ppo import compute_log_probs
from megatron_rl.rollout import SamplingParams, create_engine
from megatron_rl.rollout.reshard import sync_weights


def full_forward_routing(path: str, batch: RolloutBatch, layers: int, k: int) -> torch.Tensor:
    """[B, S, L, k] top-k of one HF forward of each whole sequence (left padded), -1 on dense layers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b, s = batch.input_ids.shape
    out = torch.full((b, s, layers, k), -1, dtype=torch.int16)
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:  # every transformers MoE block calls experts(hidden, top-k ids, weights)

            def hook(mod, args, i=i):
                out[:, :, i] = args[1].view(b, s, k).to(torch.int16)

            hooks.append(experts.register_forward_pre_hook(hook))
    mask = batch.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hf(input_ids=batch.input_ids, attention_mask=mask, position_ids=pos)
    for h in hooks:
        h.remove()
    return out


def used_ids(replays):
    """Wrap each router's hook to keep the ids it returned (what the dispatcher got)."""
    seen = {r.layer: [] for r in replays}
    for r in replays:
        inner = r.get_replay_topk

        def wrapped(*a, r=r, inner=inner, **kw):
            probs, ids = inner(*a, **kw)
            seen[r.layer].append((r.target, ids.detach().clone()))
            return probs, ids

        r.get_replay_topk = wrapped
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline stage (interleaved)")
    ap.add_argument("--packed", action="store_true", help="every pass packed (use_remove_padding)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ps = init_parallel(a.tp, a.pp, device="cpu", ep=a.ep)
    args = load_model_args(a.model)
    options = TrainingOptions(sequence_parallel=a.tp > 1, virtual_pipeline=a.vpp, packed_sequences=a.packed)
    model = build_model(args, ps, options=options)
    load_hf_weights(model, a.model, ps)
    model.eval()
    replays = routing.enable_replay(model)
    engine = create_engine(RolloutConfig(name="hf", dtype="float32"), a.model, args, ps, seed=0)
    sync_weights(model, ps, engine, bucket_megabytes=512, dtype=torch.float32)

    g = torch.Generator().manual_seed(100 + ps.dp_rank)
    lengths = [5, 9, 3, 7]
    items = [
        PromptItem(torch.randint(3, args.vocab_size, (n,), generator=g).tolist(), "toy", None, index=i)
        for i, n in enumerate(lengths)
    ]
    params = SamplingParams(
        greedy=True,
        max_new_tokens=6,
        stop_token_ids=list(range(3, 3 + args.vocab_size // 5)),  # some responses stop early
        return_logprobs=True,
        return_routed_experts=True,
    )
    gens = engine.generate([it.prompt_ids for it in items], params)
    batch = RolloutBatch.from_generations(items, gens, 0, 6, "u")
    re = batch.routed_experts
    layers, k = args.num_layers, args.moe_top_k
    dense = [i for i in range(layers) if not args.is_moe_layer(i)]
    real = batch.attention_mask.bool()
    last = real.cumsum(1) == real.sum(1, keepdim=True)  # [B, S] each row's last real token
    recorded = real & ~last
    rec = {"rank": ps.rank, "shape": list(re.shape), "dense_layers": dense}
    rec["dense_all_none"] = bool((re[:, :, dense] == -1).all()) if dense else True
    rec["unrecorded_all_none"] = bool((re[~recorded] == -1).all())
    moe = [i for i in range(layers) if args.is_moe_layer(i)]
    rec["recorded_all_set"] = bool((re[recorded][:, moe] >= 0).all())
    full = full_forward_routing(a.model, batch, layers, k)
    rec["engine_vs_full_forward"] = int(
        (re[recorded][:, moe].sort(-1).values != full[recorded][:, moe].sort(-1).values).any(-1).sum()
    )
    rec["response_lengths"] = [len(x.token_ids) for s in gens for x in s]

    engine_lp = batch.rollout_log_probs
    keep = batch.response_mask.bool()
    groups = (ps.dp_group, ps.mp_group)
    for name, micro in (
        ("fixed", MicroBatching(2)),
        ("dynamic", MicroBatching(1, max_tokens=24, key="k")),
    ):
        with torch.no_grad():
            lp = compute_log_probs(model, ps, batch, micro)
        rec[f"{name}_vs_engine"] = (lp - engine_lp)[keep].abs().max().item()
        rec[f"{name}_mismatch"] = routing.mismatch_fraction(replays, groups)
    with torch.no_grad():
        lp_free = compute_log_probs(model, ps, _without(batch), MicroBatching(2))
    rec["free_vs_engine"] = (lp_free - engine_lp)[keep].abs().max().item()
    rec["free_mismatch"] = routing.mismatch_fraction(replays, groups)  # nothing recorded: None

    shifted = _without(batch)
    shifted.routed_experts = torch.roll(re, 1, dims=1)
    with torch.no_grad():
        lp_shift = compute_log_probs(model, ps, shifted, MicroBatching(2))
    rec["shifted_vs_engine"] = (lp_shift - engine_lp)[keep].abs().max().item()
    rec["shifted_mismatch"] = routing.mismatch_fraction(replays, groups)

    # R2: the trainer's own routing in a forward-only pass, mapped back to the batch's layout
    moe_real = real[:, :, None, None].expand(-1, -1, len(moe), k)
    r2 = {}
    for name, micro in (("fixed", MicroBatching(2)), ("dynamic", MicroBatching(1, max_tokens=24, key="k"))):
        with routing.recording(model, layers, k) as recording, torch.no_grad():
            compute_log_probs(model, ps, _without(batch), micro)
        r2[name] = recording.routed_experts(ps, options.sequence_parallel)
        got, want = r2[name][:, :, moe].sort(-1).values, full[:, :, moe].sort(-1).values
        rec[f"r2_{name}_vs_full"] = int((got != want)[moe_real].sum())
        rec[f"r2_{name}_none_elsewhere"] = bool((r2[name][~real] == -1).all()) and bool(
            (r2[name][:, :, dense] == -1).all()
        )
        rec[f"r2_{name}_set"] = bool((r2[name][:, :, moe][real] >= 0).all())
    rec["r2_paths_agree"] = bool(torch.equal(r2["fixed"], r2["dynamic"]))

    # perturb every router (the same noise on every rank: routers are replicated over TP/EP/DP)
    noise = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in (layer for chunk in chunks_of(model) for layer in chunk.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.weight.add_(3.0 * torch.randn(router.weight.shape, generator=noise))
    replayed_r2 = _without(batch)
    replayed_r2.routed_experts = r2["dynamic"]
    for name, replayed_batch in (("", batch), ("r2_", replayed_r2)):
        seen = used_ids(replays)
        with torch.no_grad():
            compute_log_probs(model, ps, replayed_batch, MicroBatching(1, max_tokens=24, key="k"))
        rec[f"{name}perturbed_mismatch"] = routing.mismatch_fraction(replays, groups)
        replayed = total = 0
        for calls in seen.values():
            for target, ids in calls:
                have = target[:, 0] >= 0
                total += int(have.sum())
                replayed += int((ids[have] == target[have].to(ids.dtype)).all(-1).sum())
        rec[f"{name}perturbed_used_recorded"], rec[f"{name}perturbed_recorded_tokens"] = replayed, total
        for r in replays:  # unwrap
            del r.get_replay_topk

    everyone = [None] * ps.world_size
    dist.all_gather_object(everyone, rec)
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(everyone, f)
    destroy_parallel()


def _without(batch: RolloutBatch) -> RolloutBatch:
    out = batch.select(list(range(len(batch))))
    out.routed_experts = None
    return out


if __name__ == "__main__":
    main()
