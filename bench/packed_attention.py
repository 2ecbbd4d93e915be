"""Benchmark: packed attention on ragged sequences, on the trainer's kernels (models.layers.PACKED_BACKENDS:
flash / memory-efficient / math) against torch's own choice (cuDNN's first on Hopper with a recent cuDNN).

    python bench/packed_attention.py --out packed_attention.json
    python bench/packed_attention.py --device cpu --micro-batches 1 --out packed_attention.json

Micro-batches of --seqs sequences, each --prompt-len + a response length drawn from
--response-min..--response-max tokens, packed as the trainer packs them (models.packing.pack) and run
through SDPAttention's packed path with the Qwen2.5-1.5B shape's attention (12 query heads, 2 KV heads,
head dim 128; bf16 on the GPU, fp32 on the CPU): forward without grad (the log-prob passes), then
forward + backward (the updates). Each arm runs its micro-batches twice: the first pass meets every
segment shape for the first time, as a step of ragged responses does; the second repeats them, as a
later pass over the same micro-batches does. Each arm draws lengths of its own, so that no arm finds
shapes another arm met. Reports seconds per pass of all micro-batches and the largest difference
between the two arms' outputs on one micro-batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

import torch
from torch.nn.attention import SDPBackend

# torch's choice: every backend allowed, torch's own priority among them
TORCH_CHOICE = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def micro_batch(a: argparse.Namespace, rng: random.Random, dtype: torch.dtype):
    """(query [T, heads, d], key/value [T, kv_heads, d], the packed segments' bounds)."""
    from megatron_rl.models.packing import pack

    width = a.prompt_len + a.response_max
    lengths = [a.prompt_len + rng.randint(a.response_min, a.response_max) for _ in range(a.seqs)]
    mask = torch.zeros(a.seqs, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    packed = pack(torch.zeros(a.seqs, width, dtype=torch.long), mask)
    q = torch.randn(packed.tokens, HEADS, HEAD_DIM, device=a.device, dtype=dtype)
    kv = torch.randn(packed.tokens, KV_HEADS, HEAD_DIM, device=a.device, dtype=dtype)
    return q, kv, packed.params.bounds


@contextlib.contextmanager
def packed_backends(backends: list):
    """SDPAttention's packed path on ``backends`` for the block (models.layers.PACKED_BACKENDS, which
    its packed calls read when they run), the trainer's again after it."""
    import megatron_rl.models.layers as layers

    trainer = layers.PACKED_BACKENDS
    layers.PACKED_BACKENDS = backends
    try:
        yield
    finally:
        layers.PACKED_BACKENDS = trainer


def one_pass(attn, batches, grad: bool, device: str) -> float:
    """Seconds for every micro-batch's packed attention (forward, and backward with ``grad``)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for q, kv, bounds in batches:
        with torch.set_grad_enabled(grad):
            query = q.detach().requires_grad_(grad)
            out = attn._segments(query, kv, kv, bounds)
            if grad:
                out.float().sum().backward()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--micro-batches", type=int, default=16, help="micro-batches a pass")
    ap.add_argument("--seqs", type=int, default=8, help="sequences a micro-batch")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-min", type=int, default=32)
    ap.add_argument("--response-max", type=int, default=1024)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import megatron_rl.models.layers as layers

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    attn = layers.SDPAttention(None, 1, None, None)
    arms = {"trainer": layers.PACKED_BACKENDS, "torch": TORCH_CHOICE}
    result: dict = {
        "args": vars(a),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None,
    }
    for seed, (arm, backends) in enumerate(arms.items()):
        rng = random.Random(seed)
        batches = [micro_batch(a, rng, dtype) for _ in range(a.micro_batches)]
        result[arm] = {}
        with packed_backends(backends):
            for grad, kind in ((False, "forward"), (True, "forward_backward")):
                for name in ("first", "repeat"):
                    result[arm][f"{kind}_{name}_s"] = one_pass(attn, batches, grad, a.device)
        print(arm, {k: round(v, 4) for k, v in result[arm].items()}, flush=True)
    q, kv, bounds = micro_batch(a, random.Random(len(arms)), dtype)
    outs = []
    for backends in arms.values():
        with packed_backends(backends):
            outs.append(attn._segments(q, kv, kv, bounds).float())
    result["max_abs_diff"] = (outs[0] - outs[1]).abs().max().item()
    print(f"max |trainer - torch| on one micro-batch: {result['max_abs_diff']:.3g}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
