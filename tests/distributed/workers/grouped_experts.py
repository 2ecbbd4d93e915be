"""Grouped experts (GroupedExperts) against megatron's SequentialMLP on the same weights, at TP1/EP1,
EP2 and TP2 x EP2 in one launch of 4 gloo ranks; then torch_dist checkpoints across the two modules.

Per layout, on every rank: both models loaded from the same HF directory; one forward of the same
batch (logits), one backward of a fixed random projection of the logits (every parameter's gradient
under its global name); and a negative control: two experts' fc1 swapped in the grouped model.
Checkpoints: at EP2 each module saves a torch_dist checkpoint; at TP2 x EP1 each loads the other's,
and every weight must equal the HF-loaded one. Rank 0 writes the results to --out (JSON).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatron_rl import cpu_bridge
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights, named_global_params
from megatron_rl.models.experts import GroupedExperts
from megatron_rl.models.forward import causal_padding_mask, gather_tp
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.weights.ckpt_write import save_torch_dist
from megatron_rl.weights.torch_dist import load_torch_dist

LAYOUTS = {"tp1ep1": (1, 1), "ep2": (1, 2), "tp2ep2": (2, 2)}


def build(args, ps, path: str, grouped: bool):
    options = TrainingOptions(sequence_parallel=ps.tp_size > 1, moe_grouped_gemm=grouped)
    model = build_model(args, ps, options=options)
    load_hf_weights(model, path, ps)
    return model


def global_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its global name (a grouped expert's: its slice of the stack)."""
    params = list(model.parameters())
    data = [p.data for p in params]
    for p in params:
        p.data = p.grad
    grads = {n: g.detach().clone() for n, g in named_global_params(model).items()}
    for p, d in zip(params, data, strict=True):
        p.data = d
    return grads


def forward_backward(model, ps, ids, mask, proj) -> torch.Tensor:
    """Full-vocab logits [b, s, V]; gradients of sum(logits * proj) left in the parameters."""
    model.zero_grad(set_to_none=False)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with cpu_bridge.device_mode():
        logits = model(ids, pos, causal_padding_mask(mask))  # [b, s, V_pad/TP]
    shard = logits.shape[-1]
    (logits * proj[..., ps.tp_rank * shard : (ps.tp_rank + 1) * shard]).sum().backward()
    return gather_tp(logits.detach(), ps)


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    return (a[worst] - b[worst]).abs().max().item(), worst


def compare(args, ps, path: str) -> dict:
    seq, grp = build(args, ps, path, False), build(args, ps, path, True)
    stacks = [m for m in grp.modules() if isinstance(m, GroupedExperts)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    proj = torch.randn(3, 10, args.padded_vocab(ps.tp_size), generator=g)
    ref = forward_backward(seq, ps, ids, mask, proj)
    out = forward_backward(grp, ps, ids, mask, proj)
    grad_diff, grad_worst = max_diff(global_grads(seq), global_grads(grp))
    seq_experts = {n for n, _ in seq.named_parameters() if ".local_experts." in n}
    rec = {
        "grouped_modules": len(stacks),
        "sequential_expert_params": len(seq_experts),
        "grouped_expert_params": sum(1 for n, _ in grp.named_parameters() if "experts.weight" in n),
        "max_logit": ref.abs().max().item(),
        "logit_diff": (ref - out).abs().max().item(),
        "grad_diff": grad_diff,
        "grad_worst": grad_worst,
        "max_grad": max(g.abs().max().item() for g in global_grads(seq).values()),
        "weight_diff": max_diff(named_global_params(seq), named_global_params(grp))[0],
    }
    with torch.no_grad():  # negative control: experts 0 and 1 of this rank trade their fc1
        w = stacks[0].weight1
        w[[0, 1]] = w[[1, 0]]
    rec["swapped_logit_diff"] = (ref - forward_backward(grp, ps, ids, mask, proj)).abs().max().item()
    return rec


def cross_checkpoints(args, path: str, root: str) -> dict:
    """Save with each module at EP2; load the other's checkpoint at TP2 x EP1; compare with HF."""
    ps = init_parallel(1, 1, seed=1, device="cpu", ep=2)
    for grouped in (False, True):
        save_torch_dist(build(args, ps, path, grouped), ps, os.path.join(root, f"grouped{int(grouped)}"))
    ps = init_parallel(2, 1, seed=1, device="cpu", ep=1)
    rec = {}
    for grouped in (False, True):
        want = named_global_params(build(args, ps, path, grouped))
        model = build_model(
            args, ps, options=TrainingOptions(sequence_parallel=True, moe_grouped_gemm=grouped)
        )
        load_torch_dist(model, ps, os.path.join(root, f"grouped{int(not grouped)}"))
        got = named_global_params(model)
        rec[f"grouped{int(grouped)}_loads_other"] = {
            "names": len(got),
            "equal": got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want),
        }
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    args = load_model_args(a.model)
    results = {}
    for name, (tp, ep) in LAYOUTS.items():
        ps = init_parallel(tp, 1, seed=1, device="cpu", ep=ep)
        rec = compare(args, ps, a.model)
        recs = [None] * ps.world_size
        dist.all_gather_object(recs, rec)
        results[name] = recs
    ckpt = cross_checkpoints(args, a.model, os.path.join(os.path.dirname(a.out), "ckpt"))
    results["checkpoints"] = ckpt
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
