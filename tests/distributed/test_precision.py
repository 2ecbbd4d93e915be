"""Stochastic rounding keeps bf16 replicas bit-identical over DP and TP (torchrun/gloo, 2 ranks)."""

import pytest

from tests.conftest import read_json


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory) -> dict[int, dict]:
    """{tp: the worker's result}: DP2 and TP2 in one launch of 2 processes."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("precision")
    run_torchrun_runs(
        "precision",
        2,
        [["--model", hf_dir, "--tp", str(tp), "--out", str(root / f"tp{tp}.json")] for tp in (1, 2)],
    )
    return {tp: read_json(str(root / f"tp{tp}.json")) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_stochastic_rounding_keeps_replicas_identical(results, tp):
    """DP2: megatron's distributed optimizer (each rank rounds its own shard, then the all-gather) and
    the plain one (each rank rounds the whole parameter with the same noise); TP2: norm weights."""
    r = results[tp]
    assert r["dp_size"] * r["tp_size"] == 2
    for name in ("distributed", "plain"):
        assert r[name]["update_frac"] > 0.05, "the rounding moved (almost) nothing: the test proves nothing"
        assert r[name]["dp_diff_elements"] == 0 and r[name]["tp_diff_elements"] == 0, (name, r[name])
    # Negative control: noise seeded per rank makes each replica round its own way.
    control = r["plain_rank_seed"]
    assert control["dp_diff_elements"] + control["tp_diff_elements"] > 0, control
