"""Benchmark: the actor's training pass on Transformer Engine's layers against megatron-core's local ones.

    python bench/te_layers.py --out te_layers.json                  # Qwen2.5-1.5B's shape, bf16
    python bench/te_layers.py --batch 8 --seq 768 --steps 5 --out te_layers.json
    python bench/te_layers.py --hide-te --profile --out hidden.json  # the local layers, TE not importable

The trainer's actor (``build_model``, ``*.megatron.override_transformer_config.transformer_impl`` set
to each implementation in turn) of the Qwen2.5-1.5B shape with random weights, on one GPU: the forward
of [batch, seq] tokens (one left-padded row, the trainer's padding mask), the mean log-prob of the next
token through the fused log-prob head on the response half, and its backward. Reports milliseconds per
forward + backward, tokens/s and MFU (6 x parameters x tokens, plus attention's 12 x layers x hidden x
seq^2 / 2 per row, against the bf16 peak measured here with one large matmul) for each, and the
speed-up. Needs a CUDA GPU and, for the TE run, Transformer Engine (launch/build_te.sh).

``--hide-te`` makes Transformer Engine unimportable in this process (before megatron-core is imported,
which imports it when it can), so that the local layers' pass can be timed with and without TE merely
installed: run the script once with it and once without, in fresh processes. ``--profile`` adds a
table of the pass's heaviest CUDA kernels and the GPU's busy time by kind (attention, GEMM, other)
against the pass's wall time; each run records the cuDNN that torch uses and the cuDNN
libraries the process has loaded. ``--te-first`` imports Transformer Engine before the trainer starts,
as a process that imports it first does: TE then loads the first cuDNN it finds (a CUDA toolkit's, say)
before torch loads its own, and torch, finding a cuDNN other than its own, runs without cuDNN
(``parallel.load_torch_cudnn`` is the trainer's guard against that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def run(impl: str, args, ps, batch: int, seq: int, steps: int, profile: bool = False) -> dict:
    from megatron_rl.models.builder import TrainingOptions, build_model
    from megatron_rl.models.forward import causal_padding_mask, output_positions
    from megatron_rl.models.logprobs import fused_log_probs_and_entropy

    options = TrainingOptions(transformer_overrides=(("transformer_impl", impl),))
    model = build_model(args, ps, "actor", dtype=torch.bfloat16, options=options)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    ids = torch.randint(3, args.vocab_size, (batch, seq), device="cuda", generator=g)
    keep = torch.ones_like(ids)
    keep[0, : seq // 4] = 0
    mask = causal_padding_mask(keep)
    half = slice(seq // 2 - 1, seq - 1)

    def head(hidden, weight):  # [r, b, h] -> [r, b, 1]: log-probs of the response half
        return fused_log_probs_and_entropy(hidden, weight, ids[:, seq // 2 :].T, ps, args.vocab_size)[
            ..., None
        ]

    def step() -> None:
        with output_positions(model, lambda: half, head):
            out = model(ids, None, mask)
        out.float().mean().backward()

    for _ in range(2):  # warm-up: kernels chosen, jit fusions compiled
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    n = sum(p.numel() for p in model.parameters())
    flops = 6 * n * batch * seq + 3 * 2 * args.num_layers * args.hidden_size * seq * seq * batch
    peak_mem = torch.cuda.max_memory_allocated() / 2**30
    out = dict(
        ms=ms, tokens_per_s=batch * seq / ms * 1e3, tflops=flops / ms / 1e9, params=n, peak_gib=peak_mem
    )
    if profile:
        out["kernels"] = kernel_table(step)
    return out


KERNEL_KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma")),
)
"""Kernel-name fragments of the two kinds a pass's time is split into (the first match wins); the rest
is "other": norms, activations, adds, casts, the log-prob head's softmax, copies."""


def kernel_table(step, top: int = 15) -> dict:
    """One pass under the profiler: its heaviest ``top`` CUDA kernels ([[name, total ms, calls]]), the
    GPU's busy milliseconds by kind (attention, GEMM, other) and the pass's wall time; wall minus busy
    is time the GPU waited on the host (printed too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    rows = [
        [e.key, e.device_time_total / 1e3, e.count] for e in prof.key_averages() if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    busy = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for name, total_ms, _ in rows:
        low = name.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in low for f in frags)), "other")
        busy[kind] += total_ms
    for name, total_ms, calls in rows[:top]:
        print(f"  {total_ms:9.2f} ms  {calls:5d}x  {name[:100]}")
    total = sum(busy.values())
    split = ", ".join(f"{k} {v:.1f}" for k, v in busy.items())
    print(f"  GPU busy {total:.1f} ms ({split}) of {wall_ms:.1f} ms wall (profiler on)")
    return {"top": rows[:top], "busy_ms": busy, "wall_ms": wall_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=768)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hide-te", action="store_true", help="Transformer Engine unimportable here")
    ap.add_argument("--profile", action="store_true", help="a table of the pass's heaviest CUDA kernels")
    ap.add_argument(
        "--te-first",
        action="store_true",
        help="import Transformer Engine before the trainer starts (TE's cuDNN loads before torch's)",
    )
    a = ap.parse_args()
    if a.hide_te:  # None in sys.modules: "import transformer_engine" raises ImportError
        sys.modules.update(dict.fromkeys(("transformer_engine", "transformer_engine_torch"), None))
    if a.te_first:
        import transformer_engine.pytorch  # noqa: F401

    from transformers import Qwen2Config

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models import te_spec
    from megatron_rl.models.random_hf import QWEN25_1_5B
    from megatron_rl.parallel import cudnn_libraries, destroy_parallel, init_parallel

    with tempfile.TemporaryDirectory() as d:
        Qwen2Config(**QWEN25_1_5B, architectures=["Qwen2ForCausalLM"]).save_pretrained(
            d
        )  # the shape only: weights are drawn on the GPU
        args = load_model_args(d)
    ps = init_parallel(1, 1, seed=0, device="cuda")
    peak = peak_tflops()
    impls = [te_spec.LOCAL] + ([te_spec.TRANSFORMER_ENGINE] if te_spec.te_import_error() is None else [])
    res = {"peak_tflops": peak, "batch": a.batch, "seq": a.seq, "gpu": torch.cuda.get_device_name()}
    res["te_importable"] = te_spec.te_import_error() is None
    try:
        res["cudnn"] = torch.backends.cudnn.version()
    except RuntimeError as e:  # torch refused the cuDNN loaded first (--te-first)
        res["cudnn"] = str(e).splitlines()[0]
    res["cudnn_libraries"] = sorted(cudnn_libraries())
    print(f"TE importable: {res['te_importable']}; cuDNN {res['cudnn']} from {res['cudnn_libraries'][:2]}")
    for impl in impls:
        r = run(impl, args, ps, a.batch, a.seq, a.steps, a.profile)
        torch.cuda.empty_cache()  # the model of this run is gone
        torch.cuda.reset_peak_memory_stats()
        r["mfu"] = r["tflops"] / peak
        res[impl] = r
        rate = f"{r['ms']:.1f} ms/pass, {r['tokens_per_s']:.0f} tok/s"
        print(f"{impl}: {rate}, MFU {r['mfu']:.1%}, peak {r['peak_gib']:.1f} GiB")
    if len(impls) == 2:
        res["speedup"] = res[te_spec.LOCAL]["ms"] / res[te_spec.TRANSFORMER_ENGINE]["ms"]
        print(f"TE speed-up {res['speedup']:.2f}x (bf16 matmul peak {peak:.0f} TFLOP/s)")
    destroy_parallel()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
