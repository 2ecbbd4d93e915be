"""Worker (4 ranks): Megatron checkpoints written at one layout load at others with the HF model's logits.

1. Legacy: at TP=2 x PP=2, every rank saves what Megatron-LM saves (``state_dict_for_save_checkpoint``
   with local layer indices, the args Namespace, numpy RNG state) to iter_0000007/mp_rank_TT_PPP;
   then the checkpoint is loaded at TP=1, architecture from the saved args alone. Negative control:
   the same files with the two TP ranks' directories swapped.
2. torch_dist: actor and critic saved at TP=2 (DP=2, both replicas call save), loaded at TP=1,
   PP=2 and TP=2 x PP=2; a critic built from the actor's checkpoint gets the actor's trunk.

Rank 0 writes the logits/values differences to --out. Heavy imports live inside main():
dist_checkpointing spawns a helper process that re-imports this module.
"""

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import random
    from dataclasses import dataclass

    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.forward import broadcast_from_last_stage, gather_tp, run_pipeline
    from megatron_rl.models.loading import load_model_args_any, load_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weights.ckpt_write import save_torch_dist
    from megatron_rl.weights.megatron_args import megatron_args_from_model_args

    @dataclass
    class MB:
        input_ids: torch.Tensor
        attention_mask: torch.Tensor

    hf_args = load_model_args(a.hf)
    V = hf_args.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 2, 10), generator=g)  # 2 micro-batches of [2, 10]
    mask = torch.ones_like(ids)
    mask[1, 0, :3] = 0  # left padding
    mbs = [MB(ids[i], mask[i]) for i in range(2)]

    def forward(model, ps, critic=False):
        """[2, 2, 10, V] logits (or [2, 2, 10] values), on every rank."""
        model.eval()
        cut = (lambda mb, out: out[..., 0]) if critic else (lambda mb, out: gather_tp(out, ps)[..., :V])
        with torch.no_grad():
            outs = run_pipeline(model, ps, mbs, cut, True)
        shape = (2, 2, 10) if critic else (2, 2, 10, V)
        res = torch.stack(outs) if ps.is_last_stage else None
        return broadcast_from_last_stage(res, ps, shape, torch.float32)

    def real(x):
        return x[mask.bool()]

    results = {}

    # ---- 1. legacy checkpoint written by the TP2 x PP2 model itself, as Megatron-LM does ----------
    legacy = os.path.join(a.work, "legacy")
    ps = init_parallel(2, 2, device="cpu")
    model = build_model(hf_args, ps)
    load_hf_weights(model, a.hf, ps)
    rank_dir = os.path.join(legacy, "iter_0000007", f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")
    os.makedirs(rank_dir, exist_ok=True)
    state = {
        "args": megatron_args_from_model_args(hf_args, 2, 2, hf_args.padded_vocab(2), torch.float32, 7),
        "checkpoint_version": 3.0,
        "iteration": 7,
        "model": model.state_dict_for_save_checkpoint(),
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": None,
                "rng_tracker_states": {},
            }
        ],
        "num_floating_point_operations_so_far": 0,
    }
    torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    if ps.rank == 0:
        with open(os.path.join(legacy, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")
        # negative control: TP rank directories swapped
        swapped = os.path.join(a.work, "legacy_swapped", "iter_0000007")
        os.makedirs(swapped)
        for t in range(2):
            for p in range(2):
                os.symlink(
                    os.path.join(legacy, "iter_0000007", f"mp_rank_{1 - t:02d}_{p:03d}"),
                    os.path.join(swapped, f"mp_rank_{t:02d}_{p:03d}"),
                )
    dist.barrier()

    # init_parallel rebuilds megatron's groups for a new layout in the same torch.distributed world.
    ps = init_parallel(1, 1, device="cpu")  # DP=4: every rank loads the whole model
    hf_logits = None
    if ps.rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            a.hf, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            hf_logits = torch.stack(
                [hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits for mb in mbs]
            )
        results["max_logit"] = real(hf_logits).abs().max().item()

    def vs_hf(logits):
        return (real(logits) - real(hf_logits)).abs().max().item() if ps.rank == 0 else None

    for name, path in (
        ("legacy_tp1", legacy),
        ("legacy_swapped_tp1", os.path.join(a.work, "legacy_swapped", "iter_0000007")),
    ):
        args = load_model_args_any(path)  # only the saved args Namespace describes the model
        results[f"{name}_vocab"] = args.vocab_size
        model = build_model(args, ps)
        load_weights(model, path, ps)
        results[name] = vs_hf(forward(model, ps))

    # ---- 2. torch_dist saved at TP2 (DP2), loaded at TP1, PP2, TP2xPP2 ----------------------------
    td, td_critic = os.path.join(a.work, "td"), os.path.join(a.work, "td_critic")
    ps = init_parallel(2, 1, device="cpu")
    model = build_model(hf_args, ps)
    load_hf_weights(model, a.hf, ps)
    save_torch_dist(model, ps, td)

    def random_value_head(critic):
        with torch.no_grad():
            gv = torch.Generator().manual_seed(1)
            if ps.is_last_stage:  # same random value head on every TP rank
                critic.output_layer.weight.copy_(
                    torch.randn(critic.output_layer.weight.shape, generator=gv) / 8
                )
                critic.output_layer.bias.fill_(0.25)

    critic = build_model(hf_args, ps, role="critic")
    load_hf_weights(critic, a.hf, ps)
    random_value_head(critic)
    save_torch_dist(critic, ps, td_critic)
    values_saved = forward(critic, ps, critic=True)
    results["value_scale"] = values_saved.abs().max().item()

    logits_at = {}
    for tp, pp in ((1, 1), (1, 2), (2, 2)):
        ps = init_parallel(tp, pp, device="cpu")
        args = load_model_args_any(td)
        model = build_model(args, ps)
        load_weights(model, td, ps)
        logits_at[(tp, pp)] = forward(model, ps)
        results[f"td_tp{tp}pp{pp}"] = vs_hf(logits_at[(tp, pp)])
        critic = build_model(args, ps, role="critic")
        load_weights(critic, td_critic, ps)
        results[f"critic_tp{tp}pp{pp}"] = (forward(critic, ps, critic=True) - values_saved).abs().max().item()
        if (tp, pp) == (1, 1):  # a critic started from the actor's checkpoint takes its trunk
            critic = build_model(args, ps, role="critic")
            load_weights(critic, td, ps)
            random_value_head(critic)
            results["critic_from_actor"] = (
                (forward(critic, ps, critic=True) - values_saved).abs().max().item()
            )
    results["td_tp1_vs_pp2"] = (logits_at[(1, 1)] - logits_at[(1, 2)]).abs().max().item()

    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    destroy_parallel()


if __name__ == "__main__":
    main()
