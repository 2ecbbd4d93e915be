"""Worker: LoRA adapters on megatron's parallel linears against PEFT on the HF model, in one launch of 2
gloo ranks, at TP1 (two data-parallel replicas), TP2 and TP2 with sequence parallelism.

Per layout, every rank: the model loaded from the HF directory, adapters added and filled from a PEFT
directory with O(1) random A and B (--peft); logits on fixed tokens; the gradients of every adapter
for a fixed random projection of the logits, mapped into PEFT's tensor names (a fused linear's A
gradient is the sum of its projections' in PEFT); the logits with the adapters disabled (the
reference policy) and with every B zeroed (must equal the base), and with one A perturbed (must not);
the weights streamed to the engine (adapters merged). At TP2 a torch_dist checkpoint of the model is
written (--ckpt), and loaded back at TP1. Rank 0 writes tensors to --out (torch.save) for the test's
comparison with PEFT.
"""

import argparse
import os

import torch
import torch.distributed as dist

from megatron_rl import cpu_bridge
from megatron_rl.config.lora import LoraConfig
from megatron_rl.model_args import load_model_args
from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
from megatron_rl.models.forward import causal_padding_mask, gather_tp
from megatron_rl.models.lora import adapters, adapters_disabled, add_adapters
from megatron_rl.models.lora_files import load_peft
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout.reshard import iter_hf_buckets
from megatron_rl.weights.ckpt_write import save_torch_dist
from megatron_rl.weights.tables import hf_shapes, param_layouts
from megatron_rl.weights.torch_dist import load_torch_dist

LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2sp": (2, True)}
RANK, ALPHA = 4, 8.0


def build(path: str, ps, sp: bool, peft: str | None, lora: bool = True):
    args = load_model_args(path)
    model = build_model(args, ps, options=TrainingOptions(sequence_parallel=sp, lora=True))
    load_hf_weights(model, path, ps)
    if lora:
        spec = LoraConfig(rank=RANK, alpha=ALPHA)
        add_adapters(model, spec, ps, "actor_rollout_ref.model.lora", path, seed=3)
        if peft:
            load_peft(model, peft, ps, "actor_rollout_ref.model.lora.adapter_path")
    return model


def tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def logits(model, ps, ids, mask, grad_proj=None) -> torch.Tensor:
    """Full-vocab logits [b, s, V]; with ``grad_proj``, the gradients of sum(logits * proj) too."""
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad_proj is not None), cpu_bridge.device_mode():
        out = model(ids, pos, causal_padding_mask(mask))  # [b, s, V_pad/TP]
    if grad_proj is not None:
        shard = out.shape[-1]
        (out * grad_proj[..., ps.tp_rank * shard : (ps.tp_rank + 1) * shard]).sum().backward()
        # sequence parallelism: megatron's finalize_model_grads sums the marked factors over TP
        for _, a in adapters(model):
            for p in (a.A, a.B):
                if getattr(p, "sequence_parallel", False) and ps.tp_size > 1:
                    dist.all_reduce(p.grad, group=ps.tp_group)
    return gather_tp(out.detach(), ps)[..., : model.args.vocab_size]


def peft_space(model, ps, which: str) -> dict[str, torch.Tensor]:
    """Every adapter's A and B (``which="data"``) or their gradients ("grad"), in PEFT's names and
    full shapes (a fused linear's A under each of its projections), summed over TP from the shards."""
    layouts = {lay.name: lay for lay in param_layouts(model.args, ps.tp_size)}
    shapes = hf_shapes(model.args)  # HF [rows, cols] of each projection
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters(model):
        A, B = (getattr(a.A, which), getattr(a.B, which))
        lay = layouts[f"{name}.weight"]  # adapters() names them globally
        off, seen = 0, set()
        for pc in lay.pieces[ps.tp_rank]:
            key = f"base_model.model.{pc.hf_name.removesuffix('.weight')}"
            n = pc.stop - pc.start
            rows, cols = shapes[pc.hf_name]
            full_a = out.setdefault(f"{key}.lora_A.weight", torch.zeros(RANK, cols))
            full_b = out.setdefault(f"{key}.lora_B.weight", torch.zeros(rows, RANK))
            if lay.dim == 0:  # column: B's rows; A replicated (counted once)
                full_b[pc.start : pc.stop] += B[off : off + n]
                if ps.tp_rank == 0 and key not in seen:  # a projection's rows may be several pieces
                    full_a += A
            elif lay.dim == 1:  # row: A's columns; B replicated
                full_a[:, pc.start : pc.stop] += A[:, off : off + n]
                if ps.tp_rank == 0 and key not in seen:
                    full_b += B
            elif ps.tp_rank == 0:  # whole on every rank
                full_a += A
                full_b += B
            off += n
            seen.add(key)
    for t in out.values():
        dist.all_reduce(t, group=ps.tp_group)
    return out


def run_layout(a, name: str, tp: int, sp: bool) -> dict:
    ps = init_parallel(tp, 1, device="cpu")
    torch.manual_seed(1)
    model = build(a.model, ps, sp, a.peft)
    args = model.args
    ids, mask = tokens(args.vocab_size)
    # the test's projection: real tokens only (padded positions differ between implementations)
    proj = torch.randn(2, 12, args.vocab_size, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    proj = torch.nn.functional.pad(proj, (0, args.padded_vocab(tp) - args.vocab_size))
    res = {"logits": logits(model, ps, ids, mask, proj)}
    res["grads"] = peft_space(model, ps, "grad")
    res["weights"] = peft_space(model, ps, "data")
    with torch.no_grad():
        with adapters_disabled(model):
            res["disabled"] = logits(model, ps, ids, mask)
        base = build(a.model, ps, sp, None, lora=False)
        res["base"] = logits(base, ps, ids, mask)
        saved = {n: a_.B.detach().clone() for n, a_ in adapters(model)}
        for _, a_ in adapters(model):
            a_.B.zero_()
        res["b_zero"] = logits(model, ps, ids, mask)
        for n, a_ in adapters(model):
            a_.B.copy_(saved[n])
        first = next(a_ for _, a_ in adapters(model))
        kept = first.A.detach().clone()
        first.A.add_(0.5 * torch.randn(first.A.shape, generator=torch.Generator().manual_seed(9)))
        res["a_perturbed"] = logits(model, ps, ids, mask)
        first.A.copy_(kept)
        res["stream"] = {}
        for bucket in iter_hf_buckets(model, ps, 1 << 20, torch.float32):
            res["stream"].update({n: t.clone() for n, t in bucket})
    if name == "tp2":
        save_torch_dist(model, ps, a.ckpt)
        res["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        res["frozen_with_grad"] = [
            n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
        ]
    return res


def reload_at_tp1(a) -> dict:
    """The TP2 checkpoint loaded into a TP1 model (fresh adapters) -> its adapters in PEFT's names."""
    ps = init_parallel(1, 1, device="cpu")
    model = build(a.model, ps, False, None)
    load_torch_dist(model, ps, a.ckpt)
    out = peft_space(model, ps, "data")
    plain = build(a.model, ps, False, None, lora=False)
    try:
        load_torch_dist(plain, ps, a.ckpt)
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return {"weights": out, "refusal": refusal}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--peft", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {name: run_layout(a, name, tp, sp) for name, (tp, sp) in LAYOUTS.items()}
    results["reload"] = reload_at_tp1(a)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
