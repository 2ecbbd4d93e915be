"""Routing replay (actor_rollout_ref.actor.router_replay.mode=R3, and R2's recording) at EP2, TP2 x EP2
(sequence parallel) and PP2, on gloo ranks against the transformers engine
(tests/distributed/workers/routing_replay.py).

Each token's recorded experts travel engine -> Generation -> RolloutBatch -> (compacted) micro-batches ->
each router of the actor; a layout slip (token order, sequence-parallel chunk, compaction, left
padding) would make the trainer's own routing disagree with the replayed one, which the router counts.
A DeepSeek-V3 actor (sigmoid routing with the expert-score bias, grouped top-k) replays at EP2 too.
The *_thd layouts run every pass packed (use_remove_padding, models/packing.py): the routing reaches
the routers in packed token order (filler tokens of the TP multiple unrecorded) and R2's record maps back
from it, with the same checks.
"""

import pytest

from tests.conftest import read_json

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> dict[str, str]:
    """{arch: path}: Qwen3-MoE with layer 1 dense, DeepSeek-V3 with layer 0 dense (4 experts, top-2)."""
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf_moe_replay")
    qwen, dsv3 = str(root / "qwen3_moe"), str(root / "deepseek_v3")
    save_random_hf_model(qwen, "qwen3_moe", seed=11, mlp_only_layers=[1], num_hidden_layers=4)
    dims = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, num_hidden_layers=4)
    save_random_hf_model(dsv3, "deepseek_v3", seed=13, **dims)
    return {"qwen3_moe": qwen, "deepseek_v3": dsv3}


# id: (tp, ep, pp, nproc, arch); pp2_vpp2: two model chunks per stage (interleaved 1F1B)
LAYOUTS = {
    "ep2": (1, 2, 1, 2, "qwen3_moe"),
    "pp2_vpp2": (1, 1, 2, 2, "qwen3_moe"),
    "tp2ep2_sp": (2, 2, 1, 4, "qwen3_moe"),
    "pp2": (1, 1, 2, 2, "qwen3_moe"),
    "dsv3_ep2": (1, 2, 1, 2, "deepseek_v3"),
    "ep2_thd": (1, 2, 1, 2, "qwen3_moe"),
    "tp2_sp_thd": (2, 1, 1, 2, "qwen3_moe"),
    "dsv3_ep2_thd": (1, 2, 1, 2, "deepseek_v3"),
}
DENSE = {"qwen3_moe": [1], "deepseek_v3": [0]}


@pytest.fixture(scope="module")
def results(hf_model, tmp_path_factory) -> dict[str, list[dict]]:
    """{layout id: every rank's record}: one launch per process count."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("replay")
    launches: dict[int, list[list[str]]] = {}
    for name, (tp, ep, pp, nproc, arch) in LAYOUTS.items():
        layout = ["--tp", str(tp), "--ep", str(ep), "--pp", str(pp)]
        layout += ["--vpp", "2"] if name.endswith("_vpp2") else []
        layout += ["--packed"] if name.endswith("_thd") else []
        launches.setdefault(nproc, []).append(
            ["--model", hf_model[arch], *layout, "--out", str(root / f"{name}.json")]
        )
    for nproc, runs in launches.items():
        run_torchrun_runs("routing_replay", nproc, runs)
    return {name: read_json(str(root / f"{name}.json")) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_uses_the_recorded_routing(results, layout):
    tp, ep, pp, nproc, arch = LAYOUTS[layout]
    ranks = results[layout]
    assert len(ranks) == nproc
    for r in ranks:
        where = f"{arch} TP{tp} EP{ep} PP{pp} rank {r['rank']}"
        b, s, layers, k = r["shape"]
        assert (b, layers, k) == (4, 4, 2), where
        assert r["dense_layers"] == DENSE[arch] and r["dense_all_none"], where
        assert r["unrecorded_all_none"] and r["recorded_all_set"], where
        assert len(set(r["response_lengths"])) > 1, f"{where}: every response has one length"
        # the KV-cached decode routed every token as one forward of the whole sequence does
        assert r["engine_vs_full_forward"] == 0, where
        for name in ("fixed", "dynamic"):
            assert r[f"{name}_vs_engine"] < TOL, f"{where} {name}: {r[f'{name}_vs_engine']:.2e}"
            assert r[f"{name}_mismatch"] == 0.0, f"{where} {name}: the trainer's routers disagree"
        assert r["free_mismatch"] is None and r["free_vs_engine"] < TOL, where
        # negative control: routing one position off is visible in the count and the log-probs
        assert r["shifted_mismatch"] > 0.3, where
        assert r["shifted_vs_engine"] > 100 * TOL, where
        # R2's record: the trainer's own routing of every real token, whatever the micro-batching
        for name in ("fixed", "dynamic"):
            assert r[f"r2_{name}_vs_full"] == 0, f"{where} R2 {name}"
            assert r[f"r2_{name}_set"] and r[f"r2_{name}_none_elsewhere"], f"{where} R2 {name}"
        assert r["r2_paths_agree"], where
        # perturbed routers would choose otherwise, yet every router used the recorded experts (R3: the
        # engine's; R2: the unperturbed pass's, the last token of each row included)
        for name in ("", "r2_"):
            assert r[f"{name}perturbed_mismatch"] > 0.2, f"{where} {name}"
            assert r[f"{name}perturbed_recorded_tokens"] > 0, f"{where} {name}"
            assert r[f"{name}perturbed_used_recorded"] == r[f"{name}perturbed_recorded_tokens"], (
                f"{where} {name}"
            )
    # R2 records each row's last token too (the engine never reads it); under sequence parallelism a
    # rank holds a chunk of the sequence, so count over every rank
    assert sum(r["r2_perturbed_recorded_tokens"] for r in ranks) > sum(
        r["perturbed_recorded_tokens"] for r in ranks
    )
