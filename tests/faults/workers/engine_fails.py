"""The trainer (``megatron_rl.train``) with the generator of rank $FAULT_RANK failing at the training
rollout of step $FAULT_STEP, $FAULT_TIMES times in a row: as a crashed engine does (rollout.base.
EngineDied, what an engine raises when its worker or the connection to it is gone), or, with
$FAULT_KIND=bug, as a bug in generation does (a plain RuntimeError).

The failure is raised inside the transformers engine's generator (the boundary: the engine's worker,
which a CPU engine does not have as a process of its own to kill); the rank's TP peer waits for its
results in the engine's collectives, as it would for a crashed SGLang engine.
"""

import os
import sys

from megatron_rl.rollout import hf_engine
from megatron_rl.rollout.base import EngineDied

RANK, STEP, TIMES = os.environ["FAULT_RANK"], int(os.environ["FAULT_STEP"]), int(os.environ["FAULT_TIMES"])
BUG = os.environ.get("FAULT_KIND") == "bug"

if os.environ.get("RANK") == RANK:
    real_generate = hf_engine.HFEngine.generate_local
    failed = [0]

    def generate(self, prompts, origins, params):
        if not params.validate and params.step == STEP and failed[0] < TIMES:
            failed[0] += 1
            if BUG:
                raise RuntimeError("a shape bug in generation (injected)")
            raise EngineDied("the engine's worker died (injected)")
        return real_generate(self, prompts, origins, params)

    hf_engine.HFEngine.generate_local = generate

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
