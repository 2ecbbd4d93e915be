"""Which signal a stopping job leaves for, on real gloo ranks: within a rank the first stop (a
re-placement yields to a later stop), across ranks the explicit order of run.lifecycle.PRECEDENCE (any
stop outranks a re-placement)."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_rl.run.lifecycle import PRECEDENCE, PreemptionWatch, from_precedence, precedence
from tests.conftest import run_forked_ranks

# per rank, the signals it receives in order; each keeps its first stop (else the re-placement), the
# job agrees on the strongest of the ranks'
CASES = {
    # Slurm's warning forwarded by torchrun, then torchrun's SIGTERM as it shuts its workers down
    "usr2-then-torchruns-term": ([signal.SIGUSR2, signal.SIGTERM], [signal.SIGUSR2, signal.SIGTERM]),
    "usr1-then-int-on-one-rank": ([signal.SIGUSR1, signal.SIGINT], [signal.SIGUSR1]),
    "usr1-then-term-on-one-rank": ([signal.SIGUSR1], [signal.SIGUSR1, signal.SIGTERM]),
    "term-then-usr1-on-one-rank": ([signal.SIGTERM, signal.SIGUSR1], []),
    "int-here-usr1-there": ([signal.SIGINT], [signal.SIGUSR1]),
    "usr1-alone": ([], [signal.SIGUSR1]),
}


def _worker_for(case: str):
    def worker(rank: int, init_file: str, out_dir: str) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        with PreemptionWatch() as watch:
            for s in CASES[case][rank]:
                os.kill(os.getpid(), s)  # delivered to the main thread before os.kill returns
            local = watch.signal_name
            agreed = watch.requested()
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(f"{local} {agreed} {watch.signal_name} {watch.exit_code}")
        dist.destroy_process_group()

    return worker


def _kept(sigs: list[int]) -> signal.Signals:
    """What one rank keeps: its first stop, else the re-placement."""
    stops = [s for s in sigs if s != signal.SIGUSR1]
    return signal.Signals(stops[0] if stops else sigs[0])


def _strongest(sigs: list[int]) -> signal.Signals:
    return signal.Signals(max(sigs, key=PRECEDENCE.index))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_ranks_agree_on_the_strongest_of_the_signals_they_kept(tmp_path, case):
    run_forked_ranks(_worker_for(case), tmp_path)
    per_rank = CASES[case]
    want = _strongest([_kept(sigs) for sigs in per_rank if sigs])
    for r in (0, 1):
        local = _kept(per_rank[r]).name if per_rank[r] else "no signal"
        assert (tmp_path / f"rank{r}").read_text() == f"{local} True {want.name} {128 + want}", case


def test_precedence_is_an_order_not_the_signal_numbers():
    assert [precedence(s) for s in PRECEDENCE] == [1, 2, 3, 4]
    assert precedence(signal.SIGINT) > precedence(signal.SIGUSR1)  # yet SIGINT (2) < SIGUSR1 (10)
    assert all(from_precedence(precedence(s)) == s for s in PRECEDENCE) and from_precedence(0) is None
    with pytest.raises(ValueError, match="preemption watch"):
        precedence(signal.SIGHUP)
