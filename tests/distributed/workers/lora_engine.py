"""Worker: LoRA into the transformers engine without the base (rollout.lora_sync) against the merged
stream, in one launch of 2 gloo ranks, per layout (TP2; PP2; TP1 with two data-parallel replicas).

Per layout: the tiny Qwen2 with PEFT's O(1) adapters (workers/lora.py's build); one engine fed the
merged stream (lora.merge=true), one fed the base once and then the adapters (merge=false), each
recording what crosses into it (the weight buckets' names and bytes, the adapters' names and bytes);
greedy and sampled generations (same seeds) of both engines; a second sync after the adapters moved
(a training step's worth); the actor's own log-probs of the unmerged engine's greedy tokens (what the
sync-integrity probe compares) where the stage holds the whole model; the unmerged engine with its
adapters' hooks removed (negative control). Rank 0 writes the results to --out (torch.save).
"""

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist

from megatron_rl.models.lora import adapters
from megatron_rl.parallel import destroy_parallel, init_parallel
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.reshard import sync_weights
from tests.distributed.workers.lora import build, logits

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
PROMPTS = [[5, 17, 3, 42, 8], [11, 2, 60], [7, 7, 19, 33, 1, 4, 90]]
NEW = 6


class RecordingEngine(HFEngine):
    """The transformers engine, noting what each sync hands it."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.buckets: list[tuple[str, int]] = []  # (tensor name, bytes) of the weight stream
        self.adapter_tensors: list[tuple[str, int]] = []  # (PEFT name, bytes) of the adapters

    def update_weights(self, buckets) -> None:
        def noted():
            for bucket in buckets:
                self.buckets += [(n, t.numel() * t.element_size()) for n, t in bucket]
                yield bucket

        super().update_weights(noted())

    def load_adapters(self, tensors, config) -> None:
        self.adapter_tensors += [(n, t.numel() * t.element_size()) for n, t in tensors.items()]
        super().load_adapters(tensors, config)

    def take(self) -> dict:
        out = {"buckets": self.buckets, "adapters": self.adapter_tensors}
        self.buckets, self.adapter_tensors = [], []
        return out


def generations(engine, ps) -> dict:
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=NEW, return_logprobs=True, seed=3)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=NEW, return_logprobs=True, seed=3)
    out = {}
    for kind, params in (("greedy", greedy), ("sampled", sampled)):
        gens = engine.generate(PROMPTS, params)
        out[kind] = [[(g.token_ids, torch.tensor(g.logprobs)) for g in row] for row in gens]
    return out


def actor_logprobs(model, ps, gens) -> list[torch.Tensor]:
    """The actor's log-probs (adapters on) of each prompt's greedy response: what roles.sync_check
    compares with the engine's."""
    out = []
    for prompt, row in zip(PROMPTS, gens, strict=True):
        toks, _ = row[0]
        ids = torch.tensor([prompt + toks])
        full = logits(model, ps, ids, torch.ones_like(ids))[0].float()  # [s, V]
        lp = torch.log_softmax(full, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(toks)[:, None])
        out.append(lp[:, 0])
    return out


def run_layout(a, tp: int, pp: int) -> dict:
    ps = init_parallel(tp, pp, device="cpu")
    torch.manual_seed(1)
    model = build(a.model, ps, False, a.peft)
    args, res = model.args, {}

    def engine() -> RecordingEngine:
        return RecordingEngine(args, ps, dtype=torch.float32, seed=0)

    merged, unmerged = engine(), engine()
    spec = model.lora
    model.lora = dataclasses.replace(spec, merge=True)
    res["merged_sync"] = sync_weights(model, ps, merged, 1)
    res["merged_crossed"] = merged.take()
    res["merged"] = generations(merged, ps)
    model.lora = dataclasses.replace(spec, merge=False)
    res["first_sync"] = sync_weights(model, ps, unmerged, 1)
    res["first_crossed"] = unmerged.take()
    res["unmerged"] = generations(unmerged, ps)
    if pp == 1:
        res["actor"] = actor_logprobs(model, ps, res["unmerged"]["greedy"])
    with torch.no_grad():  # a training step's worth: every adapter moves
        g = torch.Generator().manual_seed(21 + ps.tp_rank + 10 * ps.pp_rank)  # DP replicas alike
        for _, ad in adapters(model):
            ad.B.add_(0.3 * torch.randn(ad.B.shape, generator=g))
            if tp > 1 and ad.parallel == "row":  # B is replicated over TP: keep it so (a column
                dist.broadcast(ad.B, src=dist.get_global_rank(ps.tp_group, 0), group=ps.tp_group)  # B: split)
    res["second_sync"] = sync_weights(model, ps, unmerged, 1)
    res["second_crossed"] = unmerged.take()
    res["unmerged2"] = generations(unmerged, ps)
    model.lora = dataclasses.replace(spec, merge=True)
    sync_weights(model, ps, merged, 1)
    res["merged2"] = generations(merged, ps)
    if unmerged.adapters is not None:  # the DP leader's: hooks off, the engine is the base alone
        unmerged.adapters.remove()
    res["hooks_off"] = generations(unmerged, ps)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--peft", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = {name: run_layout(a, tp, pp) for name, (tp, pp) in LAYOUTS.items()}
    if int(os.environ["RANK"]) == 0:
        torch.save(results, a.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
