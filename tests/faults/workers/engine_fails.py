"""The trainer (``megatron_rl.train``) with the generator of rank $FAULT_RANK failing as a crashed engine
does (a RuntimeError out of the model's generation) at the training rollout of step $FAULT_STEP,
$FAULT_TIMES times in a row.

The failure is raised inside the transformers engine's generator (the boundary: the engine's worker,
which a CPU engine does not have as a process of its own to kill); the rank's TP peer waits for its
results in the engine's collectives, as it would for a crashed SGLang engine.
"""

import os
import sys

from megatron_rl.rollout import hf_engine

RANK, STEP, TIMES = os.environ["FAULT_RANK"], int(os.environ["FAULT_STEP"]), int(os.environ["FAULT_TIMES"])

if os.environ.get("RANK") == RANK:
    real_generate = hf_engine.HFEngine._generate_local
    failed = [0]

    def generate(self, prompts, origins, params):
        if not params.validate and params.step == STEP and failed[0] < TIMES:
            failed[0] += 1
            raise RuntimeError("the engine's worker died (injected)")
        return real_generate(self, prompts, origins, params)

    hf_engine.HFEngine._generate_local = generate

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
