"""Fixtures of the fault tests: the demo's model and data (built once), and a straight run to compare
resumed runs with."""

from __future__ import annotations

import pytest

from tests.faults import jobs


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> dict[str, str]:
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="session")
def straight(demo, tmp_path_factory) -> list[dict]:
    """The metrics rows of an uninterrupted 6-step run: the oracle of every resume."""
    run_dir = str(tmp_path_factory.mktemp("straight") / "run")
    done = jobs.run_torchrun(demo, run_dir, 6)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return jobs.rows(run_dir)
