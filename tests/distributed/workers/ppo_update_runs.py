"""Worker: several runs of ppo_update.py in one launch (one process start and one torch.distributed
world instead of one each). Each run's arguments are ppo_update.py's, the runs separated by ``--then``;
they share the number of processes and the device, and may differ in layout: each run's
``init_parallel`` builds megatron's TP/PP/DP groups for its own TP x PP anew, and each run builds its
models afresh, as separate launches would.

    torchrun --nproc_per_node=2 ppo_update_runs.py --models ... --tp 2 --micro 2 --out A \
        --then --models ... --pp 2 --micro 2 --max-tokens 24 --out B
"""

import sys

import ppo_update


def main() -> None:
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == "--then":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)

    stop = ppo_update.destroy_parallel
    ppo_update.destroy_parallel = lambda: None  # the world stays up for the next run
    for argv in runs:
        sys.argv = [ppo_update.__file__, *argv]
        ppo_update.main()
    stop()


if __name__ == "__main__":
    main()
