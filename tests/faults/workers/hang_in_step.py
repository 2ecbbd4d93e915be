"""The trainer (``megatron_rl.train``) with rank $FAULT_RANK hanging (as a stuck kernel or a dead NIC
would leave it) when the actor update of step $FAULT_STEP starts, once: $FAULT_MARK is written when it
hangs, and a restarted job that finds it runs on.

The hang is a sleep inside the rank (the boundary: a device or network stall, which a CPU job cannot
produce); the other rank waits for it in a collective until trainer.dist_timeout_minutes.
"""

import os
import sys
import time

from megatron_rl.roles import actor

RANK, STEP, MARK = os.environ["FAULT_RANK"], int(os.environ["FAULT_STEP"]), os.environ["FAULT_MARK"]

if os.environ.get("RANK") == RANK:
    real_update = actor.ActorRole.update

    def update(self, step, batch, stats):
        if step == STEP and not os.path.exists(MARK):
            with open(MARK, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        return real_update(self, step, batch, stats)

    actor.ActorRole.update = update

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
