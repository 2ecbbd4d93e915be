"""Worker: LoRA on a mixture-of-experts model (attention, the shared expert and every routed expert of
the grouped experts), in one launch of 2 gloo ranks at EP1 (two data-parallel replicas), EP2 and TP2
with expert TP 1.

Per layout: the model loaded from the HF directory, adapters added, the linears' filled from a PEFT
directory (--peft) and each routed expert's set to O(1) random values drawn from its global index;
logits on fixed tokens and every adapter's gradient (linears in PEFT's names through workers/lora.py,
experts by global index); the logits with one routed expert's B zeroed (must move), with the adapters
off (must be the base); the weights streamed to the engine (merged). At EP2 a torch_dist checkpoint is
written (--ckpt) and loaded back at EP1. Expert TP 2 must be refused. Rank 0 writes --out (torch.save).
"""

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_rl.config.lora import LoraConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
from megatron_rl.models.lora import ExpertAdapters, adapters_disabled, add_adapters
from megatron_rl.models.lora_files import fill_from_peft
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout.reshard import iter_hf_buckets
from megatron_rl.weights.ckpt_write import save_torch_dist
from megatron_rl.weights.torch_dist import load_torch_dist
from tests.distributed.workers.lora import logits, peft_space, tokens

LAYOUTS = {"ep1": (1, 1), "ep2": (1, 2), "tp2": (2, 1)}  # (TP, EP); expert TP 1
RANK, ALPHA = 4, 8.0


def expert_sets(model) -> list[tuple[int, int, ExpertAdapters]]:
    """(global layer, first global expert, adapters) of every grouped-experts module on this rank."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ExpertAdapters):
            out.append((int(name.split(".")[2]) + model.layer_offset, model.expert_offset, m))
    return out


def build(path: str, ps, peft: str | None, lora: bool = True):
    model = build_model(
        load_model_args(path), ps, options=TrainingOptions(sequence_parallel=ps.tp_size > 1, lora=True)
    )
    load_hf_weights(model, path, ps)
    if not lora:
        return model
    add_adapters(model, LoraConfig(rank=RANK, alpha=ALPHA), ps, "actor_rollout_ref.model.lora", path, 3)
    if peft:
        # the linears from PEFT's tensors; each routed expert's A and B from its global index
        fill_from_peft(model, load_file(os.path.join(peft, "adapter_model.safetensors")), ps, peft)
        with torch.no_grad():
            for layer, first, m in expert_sets(model):
                for j in range(m.A1.shape[0]):
                    g = torch.Generator().manual_seed(1000 * layer + first + j)
                    for p in (m.A1, m.B1, m.A2, m.B2):
                        p[j].copy_(torch.randn(p[j].shape, generator=g))
    return model


def expert_space(model, ps, which: str) -> dict[str, torch.Tensor]:
    """Every routed expert's adapter tensors (``which="data"``) or gradients ("grad") by global layer and
    expert, summed over the ranks. A copy is held by world / EP ranks (divided out); a gradient sums the
    tokens routed to the expert from every rank, which hold DP copies of one batch (DP divided out: one
    batch's gradient at every layout)."""
    sets = expert_sets(model)
    count, layers = model.args.num_experts, sorted({layer for layer, _, _ in sets})
    shapes = {n: getattr(sets[0][2], n).shape[1:] for n in ("A1", "B1", "A2", "B2")}
    full = {
        f"{i}.{e}.{n}": torch.zeros(shape)
        for i in layers
        for e in range(count)
        for n, shape in shapes.items()
    }
    for layer, first, m in sets:
        for j in range(m.A1.shape[0]):
            for n in shapes:
                full[f"{layer}.{first + j}.{n}"] += getattr(getattr(m, n), which)[j]
    holders = ps.dp_size if which == "grad" else dist.get_world_size() // ps.ep_size
    for t in full.values():
        dist.all_reduce(t)
        t /= holders
    return full


def run_layout(a, name: str, tp: int, ep: int) -> dict:
    ps = init_parallel(tp, 1, device="cpu", ep=ep, etp=1)
    torch.manual_seed(1)
    model = build(a.model, ps, a.peft)
    args = model.args
    ids, mask = tokens(args.vocab_size)
    proj = torch.randn(2, 12, args.vocab_size, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    proj = torch.nn.functional.pad(proj, (0, args.padded_vocab(tp) - args.vocab_size))
    res = {"logits": logits(model, ps, ids, mask, proj)}
    res["grads"] = {**peft_space(model, ps, "grad"), **expert_space(model, ps, "grad")}
    res["weights"] = {**peft_space(model, ps, "data"), **expert_space(model, ps, "data")}
    with torch.no_grad():
        with adapters_disabled(model):
            res["disabled"] = logits(model, ps, ids, mask)
        res["base"] = logits(build(a.model, ps, None, lora=False), ps, ids, mask)
        sets = expert_sets(model)
        if sets:  # one routed expert's B zeroed on the rank that holds expert 0 of the first MoE layer
            _, first, m = sets[0]
            kept = m.B1.detach().clone()
            if first == 0:
                m.B1[0].zero_()
            res["expert_b_zero"] = logits(model, ps, ids, mask)
            m.B1.copy_(kept)
        res["stream"] = {}
        for bucket in iter_hf_buckets(model, ps, 1 << 20, torch.float32):
            res["stream"].update({n: t.clone() for n, t in bucket})
    if name == "ep2":
        save_torch_dist(model, ps, a.ckpt)
    return res


def reload_at_ep1(a) -> dict:
    ps = init_parallel(1, 1, device="cpu", ep=1, etp=1)
    model = build(a.model, ps, None)
    load_torch_dist(model, ps, a.ckpt)
    return {**peft_space(model, ps, "data"), **expert_space(model, ps, "data")}


def etp2_refusal(a) -> str:
    ps = init_parallel(2, 1, device="cpu", ep=1, etp=2)
    try:
        build(a.model, ps, None)
    except ValueError as e:
        return str(e)
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--peft", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {name: run_layout(a, name, tp, ep) for name, (tp, ep) in LAYOUTS.items()}
    results["reload"] = reload_at_ep1(a)
    results["etp2"] = etp2_refusal(a)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
