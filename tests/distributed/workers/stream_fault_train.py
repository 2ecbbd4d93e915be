"""The trainer (``megatron_rl.train``) with a fault in its weight sync, for the sync-check tests.
$STREAM_FAULT is one of (syncs count from 1, buckets from 0):

  ``drop:S:B``     bucket B of weight sync S never reaches the engine;
  ``reverse:S:B``  from sync S on, the first tensor of bucket B reaches the engine with its rows
                   reversed, as a layout bug would hand it over (its checksums agree with what was sent);
  ``engine_reverse:S:NAME`` / ``engine_swap:S:NAME``
                   the stream is right, but from sync S on the engine's copy of NAME ends up with its
                   rows reversed / two of its elements swapped, as an engine-loading bug would leave it.
"""

import os
import sys

import torch

from megatron_rl.rollout import reshard
from megatron_rl.rollout.hf_engine import HFEngine

KIND, SYNC, WHERE = os.environ["STREAM_FAULT"].split(":")


def fault(sync: int, i: int, bucket) -> bool:
    if KIND.startswith("engine_") or i != int(WHERE):
        return False
    if KIND == "drop":
        return sync == int(SYNC)
    if sync >= int(SYNC):  # reverse
        bucket[0][1].copy_(bucket[0][1].flip(0).clone())
    return False


_load = HFEngine.update_weights
_engine_syncs = 0


def corrupting_update_weights(self: HFEngine, buckets) -> None:
    global _engine_syncs
    _load(self, buckets)
    _engine_syncs += 1
    if self.model is None or _engine_syncs < int(SYNC):
        return
    with torch.no_grad():
        w = self._stream_targets()[WHERE]
        if KIND == "engine_reverse":
            w.copy_(w.flip(0).clone())
        else:  # two elements of different value trade places
            flat = w.view(-1)
            a, b = flat[0].item(), flat[1].item()
            assert a != b
            flat[0], flat[1] = b, a


if KIND == "engine_reverse" or KIND == "engine_swap":
    HFEngine.update_weights = corrupting_update_weights
reshard.stream_fault = fault

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
