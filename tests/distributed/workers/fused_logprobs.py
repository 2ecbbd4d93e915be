"""Worker: the fused LM head + log-softmax on 2 TP ranks (torchrun, gloo); see
tests/distributed/test_fused_logprobs.py. Writes rank{R}.pt to --out: {vocab: {mode: outputs}}."""

import argparse
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_rl.models.logprobs import fused_log_probs_and_entropy
from tests.distributed.test_fused_logprobs import CHUNK, MODES, PADDED, TEMPERATURE, VOCABS, data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out_dir = parser.parse_args().out
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    alone = [dist.new_group([0]), dist.new_group([1])]  # every rank takes part in creating each
    layouts = {
        "tp2": SimpleNamespace(tp_size=2, tp_rank=rank, tp_group=dist.group.WORLD),
        "swapped_offset": SimpleNamespace(tp_size=2, tp_rank=1 - rank, tp_group=dist.group.WORLD),
        "no_reduction": SimpleNamespace(tp_size=2, tp_rank=rank, tp_group=alone[rank]),
    }
    local = PADDED // 2
    out = {}
    for vocab in VOCABS:
        hidden, weight, targets, w_logp, w_ent = data(vocab)
        shard = weight[rank * local : (rank + 1) * local]
        out[vocab] = {}
        for mode in MODES:
            h, w = hidden.clone().requires_grad_(True), shard.clone().requires_grad_(True)
            logp, ent = fused_log_probs_and_entropy(
                h, w, targets, layouts[mode], vocab, TEMPERATURE, with_entropy=True, chunk_tokens=CHUNK
            )
            ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
            out[vocab][mode] = {
                "logp": logp.detach(),
                "ent": ent.detach(),
                "grad_h": h.grad,
                "grad_w": w.grad,
            }
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
