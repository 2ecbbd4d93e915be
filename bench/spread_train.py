"""``megatron_rl.train`` with response lengths spread uniformly over [LO, HI] (bench/ppo_step.py).

    torchrun ... bench/spread_train.py LO HI key=value ...

A random model practically never samples EOS, so every response would run to
data.max_response_length and the batch would carry no padding at all. Real RL batches are ragged
(GSM8K responses run from tens to a thousand tokens). To measure the training passes on such a batch,
this entry point gives every SGLang request its own ``max_new_tokens``, drawn uniformly from [LO, HI]
(seeded by the request's index and a per-process call counter, so the draw differs between steps and
is the same in every run), then runs the trainer unchanged.
"""

from __future__ import annotations

import itertools
import random
import sys


def main() -> None:
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    from megatron_rl import train
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    calls = itertools.count()
    sampling = SGLangEngine._sampling

    def spread(self, params, index):
        sp = sampling(self, params, index)
        if index == 0:
            spread.call = next(calls)
        rng = random.Random(spread.call * 1_000_003 + index)
        sp["max_new_tokens"] = min(sp["max_new_tokens"], rng.randint(lo, hi))
        return sp

    spread.call = 0
    SGLangEngine._sampling = spread
    train.main(sys.argv[3:])


if __name__ == "__main__":
    main()
