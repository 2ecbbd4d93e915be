"""Worker: several runs of another worker in one launch (one process start and one torch.distributed
world instead of one each). The first argument names the worker (a module of this directory with a
``main()`` that reads ``sys.argv``); its runs' arguments follow, separated by ``--then``. The runs share
the number of processes; each run's ``init_parallel`` builds megatron's groups for its own layout anew
and each run builds its models afresh, as separate launches would.

    torchrun --nproc_per_node=2 runs.py parity --tp 2 --out A --then --pp 2 --out B
"""

import importlib
import sys


def main() -> None:
    name, runs, current = sys.argv[1], [], []
    for arg in sys.argv[2:]:
        if arg == "--then":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)

    # Patched before the worker is imported, so that its own name for it is the no-op as well: the
    # world stays up for the next run.
    import megatron_rl.parallel as parallel

    stop = parallel.destroy_parallel
    parallel.destroy_parallel = lambda: None
    worker = importlib.import_module(name)
    for argv in runs:
        sys.argv = [worker.__file__, *argv]
        worker.main()
    stop()


if __name__ == "__main__":
    main()
