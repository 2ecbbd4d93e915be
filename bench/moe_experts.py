"""Benchmark: one MoE layer's experts, grouped (GroupedExperts) against megatron's SequentialMLP.

    python bench/moe_experts.py --out experts.json                 # Qwen3-30B-A3B's experts, bf16
    python bench/moe_experts.py --device cpu --tokens 512 --out experts.json

The experts of one layer of the Qwen3-30B-A3B shape (128 experts of 768, hidden 2048, top-8) on one
device, fed --tokens tokens routed to --top-k experts each (uniformly random routing, so each expert
gets about tokens x top-k / 128 rows): the forward and backward of the experts module alone, as the
MoE layer runs it after the token dispatcher. Reports milliseconds per forward+backward, the
achieved TFLOP/s (6 x rows x 3 x hidden x ffn per pass: forward and the two backward GEMMs), and
the largest difference between the two modules' outputs on the same weights. Also checks that the
grouped module runs in fp32, bf16 and fp16 on the device.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(grouped: bool, dtype: torch.dtype, args, ps):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl import cpu_bridge
    from megatron_rl.models.builder import TrainingOptions, transformer_config
    from megatron_rl.models.experts import GroupedExperts

    cfg = transformer_config(args, ps, dtype, TrainingOptions())
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    with cpu_bridge.device_mode():
        if grouped:
            m = GroupedExperts(args.num_experts, cfg, pg_collection=pgs)
        else:
            sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            m = SequentialMLP(args.num_experts, cfg, sub, pg_collection=pgs)
    m = m.to(ps.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.02)
    return m


def same_weights(seq, grp) -> None:
    with torch.no_grad():
        for j, e in enumerate(seq.local_experts):
            e.linear_fc1.weight.copy_(grp.weight1[j])
            e.linear_fc2.weight.copy_(grp.weight2[j])


def inputs(n_tokens: int, top_k: int, experts: int, hidden: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    # each token's top-k distinct experts; rows sorted by expert, as the dispatcher permutes them
    choice = torch.rand(n_tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    rows = int(counts.sum())
    x = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    probs = torch.rand(rows, generator=g).to(device=device, dtype=torch.float32)
    return x, counts, probs


def time_module(m, x, counts, probs, repeats: int, device) -> float:
    grad = torch.randn(x.shape[0], x.shape[1], device=device, dtype=x.dtype)

    def once():
        xi = x.detach().requires_grad_()
        out, _ = m(xi, counts, probs)
        out.backward(grad)

    for _ in range(2):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens entering the layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import QWEN3_30B_A3B
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(1, 1, device=a.device)
    hf = {**QWEN3_30B_A3B, "num_hidden_layers": 1, "num_experts": a.experts, "num_experts_per_tok": a.top_k}
    args = model_args_from_hf_config(
        {**hf, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    )
    dtype = torch.bfloat16 if ps.device.type == "cuda" else torch.float32
    res: dict = {"device": str(torch.cuda.get_device_name() if ps.device.type == "cuda" else "cpu")}
    res.update(tokens=a.tokens, top_k=a.top_k, experts=a.experts, dtype=str(dtype))
    x, counts, probs = inputs(a.tokens, a.top_k, a.experts, args.hidden_size, dtype, ps.device)
    flops = 6 * x.shape[0] * 3 * args.hidden_size * args.moe_ffn_hidden_size
    grp, seq = build(True, dtype, args, ps), build(False, dtype, args, ps)
    same_weights(seq, grp)
    with torch.no_grad():
        res["max_output_diff"] = (grp(x, counts, probs)[0] - seq(x, counts, probs)[0]).abs().max().item()
    for name, m in (("grouped", grp), ("sequential", seq)):
        s = time_module(m, x, counts, probs, a.repeats, ps.device)
        res[name] = {"ms": 1e3 * s, "tflops": flops / s / 1e12}
    res["speedup"] = res["sequential"]["ms"] / res["grouped"]["ms"]
    for dt in (torch.float32, torch.bfloat16, torch.float16):  # the grouped module in each dtype
        m = build(True, dt, args, ps)
        xi, c, p = inputs(256, a.top_k, a.experts, args.hidden_size, dt, ps.device)
        out, _ = m(xi.requires_grad_(), c, p)
        out.float().sum().backward()
        res[f"runs_{str(dt).split('.')[-1]}"] = bool(torch.isfinite(out).all())
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
