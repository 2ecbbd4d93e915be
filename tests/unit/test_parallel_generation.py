"""A ParallelState built before megatron's parallel state was re-initialized is refused, not used."""

from __future__ import annotations

import os

import pytest

from megatron_rl.parallel import destroy_parallel, generation, init_parallel

STALE = "this ParallelState was built before megatron's parallel state was re-initialized"


@pytest.fixture
def environ():
    saved = dict(os.environ)  # init_parallel sets RANK/WORLD_SIZE/MASTER_*: keep them from later tests
    yield
    destroy_parallel()
    os.environ.clear()
    os.environ.update(saved)


def test_state_from_an_older_init_is_refused(environ):
    first = init_parallel(1, 1, seed=0, device="cpu")
    first.check_current()
    assert first.pp_last_rank == 0
    assert first.generation == generation()

    second = init_parallel(1, 1, seed=0, device="cpu")  # re-initializes megatron's groups
    second.check_current()
    with pytest.raises(RuntimeError, match=STALE) as e:
        first.check_current()
    assert "megatron_rl.parallel.init_parallel" in str(e.value)
    with pytest.raises(RuntimeError, match=STALE):
        _ = first.pp_last_rank  # a helper on the state checks before it uses a group

    destroy_parallel()
    with pytest.raises(RuntimeError, match=STALE):
        second.check_current()


def test_reinit_done_directly_in_megatron_is_caught(environ):
    from megatron.core import parallel_state as mps

    ps = init_parallel(1, 1, seed=0, device="cpu")
    mps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match=STALE):
        ps.check_current()  # megatron has no groups at all now
    mps.initialize_model_parallel(1, 1, create_gloo_process_groups=True)
    with pytest.raises(RuntimeError, match=STALE):
        ps.check_current()  # new group objects, not the ones ps holds


def test_hand_built_state_is_not_tracked():
    import torch

    from megatron_rl.parallel import ParallelState

    ps = ParallelState(0, 1, 0, torch.device("cpu"), "gloo", 1, 1, 1, 0, 0, 0, None, None, None, None, None)
    ps.check_current()  # no generation: nothing to compare (test doubles, hand-made layouts)
