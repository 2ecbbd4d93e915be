"""The trainer (``megatron_rl.train``) with a fault in its weight stream, for the sync-check tests:
$STREAM_FAULT is ``drop:S:B`` (bucket B of weight sync S never reaches the engine) or ``reverse:S:B``
(from sync S on, the first tensor of bucket B reaches the engine with its rows reversed, as a layout
bug would hand it over: its checksums agree with what was sent). Syncs and buckets count from 1 and 0.
"""

import os
import sys

from megatron_rl.rollout import reshard

KIND, SYNC, BUCKET = os.environ["STREAM_FAULT"].split(":")


def fault(sync: int, i: int, bucket) -> bool:
    if i != int(BUCKET):
        return False
    if KIND == "drop":
        return sync == int(SYNC)
    if sync >= int(SYNC):  # reverse
        bucket[0][1].copy_(bucket[0][1].flip(0).clone())
    return False


reshard.stream_fault = fault

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
