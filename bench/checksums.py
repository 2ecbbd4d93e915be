"""The weight sync's checksums (rollout.checksums) over the tensors of a model shape, on one device:
seconds per pass for the stream's side (``tensor_checksum`` of every tensor) and the engine's side
(``box_checksum`` of each tensor as one box, the read-back's path at TP=1), and the bandwidth they
reach. ``python bench/checksums.py --model qwen2.5-1.5b`` (random bf16 weights; GPU if there is one)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from megatron_rl.rollout.checksums import box_checksum, tensor_checksum

SHAPES = {  # hidden, ffn, layers, vocab, q heads, kv heads, head dim
    "qwen2.5-1.5b": (1536, 8960, 28, 151936, 12, 2, 128),
    "tiny": (256, 512, 2, 512, 4, 2, 64),
}


def model_tensors(name: str, device: torch.device) -> list[torch.Tensor]:
    h, f, layers, vocab, nq, nkv, hd = SHAPES[name]
    layer = [(nq * hd, h), (nkv * hd, h), (nkv * hd, h), (h, nq * hd), (f, h), (f, h), (h, f)]
    layer += [(nq * hd,), (nkv * hd,), (nkv * hd,), (h,), (h,)]  # q/k/v biases, two norms
    shapes = [(vocab, h), *layer * layers, (h,), (vocab, h)]
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for s in shapes]


def timed(fn, tensors: list[torch.Tensor], device: torch.device, repeat: int) -> float:
    fn(tensors)  # warm-up (the position-weight table is made once per device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn(tensors)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors = model_tensors(args.model, device)
    numel = sum(t.numel() for t in tensors)

    def stream(ts):
        return torch.stack([tensor_checksum(t) for t in ts]).cpu()

    def engine(ts):
        return torch.stack([box_checksum(t, t.shape[1] if t.dim() == 2 else 1) for t in ts]).cpu()

    res = {"model": args.model, "device": str(device), "tensors": len(tensors), "elements": numel}
    for name, fn in (("stream", stream), ("engine", engine)):
        s = timed(fn, tensors, device, args.repeat)
        res[f"{name}_s"] = round(s, 4)
        res[f"{name}_gb_per_s_of_bf16"] = round(2 * numel / s / 1e9, 1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
