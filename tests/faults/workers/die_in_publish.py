"""The trainer (``megatron_rl.train``), with rank 0 killed by SIGKILL at one moment of publishing the
checkpoint of step $FAULT_STEP ($FAULT_AT):

* ``renamed``: the step's directory renamed into place, the tracker not yet written;
* ``tracked``: the tracker written, the publication order not yet;
* ``published``: all of it done, the step's metrics row not yet written.

The kill comes from inside the process (the boundary: the files the publication writes), at exactly
that moment, which a signal from outside cannot hit.
"""

import os
import signal
import sys

from megatron_rl.run import checkpoint

AT, STEP = os.environ["FAULT_AT"], int(os.environ["FAULT_STEP"])


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("RANK") == "0":
    real_write, real_publish = checkpoint.write_atomic, checkpoint.CheckpointManager._publish

    def write_atomic(path: str, text: str, mode: int) -> None:
        ours = os.path.basename(path) == checkpoint.LATEST and text.strip() == str(STEP)
        if ours and AT == "renamed":
            _die()
        real_write(path, text, mode)
        if ours and AT == "tracked":
            _die()

    def publish(self, partial: str, final: str, step: int) -> None:
        real_publish(self, partial, final, step)
        if AT == "published" and step == STEP:
            _die()

    checkpoint.write_atomic = write_atomic
    checkpoint.CheckpointManager._publish = publish

if __name__ == "__main__":
    from megatron_rl.train import main

    main(sys.argv[1:])
