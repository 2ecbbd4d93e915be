"""The memory planner (run/memory_plan.py) on real models: tiny megatron GPTModels with megatron's DDP
and optimizer on a world of one (gloo, CPU), parked by offload.HostParking through
roles.models.park_for_generation; and the CUDA-graph batch size the engine is started with."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import ConfigError, OptimConfig, load_config, validate
from megatron_rl.run.memory_plan import (
    Part,
    config_plan,
    cuda_graph_max_bs,
    plan_memory,
    plan_offload,
    sglang_capture_grid,
)

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}
TOTAL = 10**9  # the device size the tests give the planner (CPU has none to read)


def cfg_with(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides])


# --------------------------------------------------------------------------------------------------
# The config keys
# --------------------------------------------------------------------------------------------------


def test_offload_keys_default_to_auto_and_keep_verl_booleans(tmp_path):
    cfg = cfg_with()
    for m in (cfg.actor_rollout_ref.actor, cfg.critic):
        assert (m.megatron.param_offload, m.megatron.grad_offload, m.megatron.optimizer_offload) == (
            "auto",
        ) * 3
    for m in (cfg.actor_rollout_ref.ref, cfg.reward_model):  # frozen: only their weights can park
        assert m.megatron.param_offload == "auto" and not hasattr(m.megatron, "grad_offload")
    f = tmp_path / "verl.yaml"  # verl's yaml writes booleans
    f.write_text(
        "actor_rollout_ref:\n  actor:\n    megatron:\n      param_offload: true\n      grad_offload: false\n"
    )
    cfg = load_config(
        str(f), ["actor_rollout_ref.model.path=/models/x", "critic.megatron.optimizer_offload=True"]
    )
    actor = cfg.actor_rollout_ref.actor.megatron
    assert actor.param_offload is True and actor.grad_offload is False and actor.optimizer_offload == "auto"
    assert cfg.critic.megatron.optimizer_offload is True
    validate(cfg, world_size=4, model_dims=DIMS)


def test_a_bad_offload_value_names_the_key():
    with pytest.raises(ConfigError, match=r"critic\.megatron\.grad_offload='sometimes'.*true, false or auto"):
        validate(cfg_with("critic.megatron.grad_offload=sometimes"), world_size=4, model_dims=DIMS)
    with pytest.raises(ConfigError, match="applies only to trained models"):
        cfg_with("reward_model.megatron.optimizer_offload=true")


# --------------------------------------------------------------------------------------------------
# The greedy plan (pure)
# --------------------------------------------------------------------------------------------------

PARTS = [
    Part("actor", "params", 100),
    Part("actor", "grads", 100),
    Part("actor", "optimizer", 200),
    Part("critic", "params", 100),
    Part("critic", "grads", 100),
    Part("critic", "optimizer", 200),
    Part("ref", "params", 100),
]


@pytest.mark.parametrize(
    "need, parked",
    [
        (0, set()),
        (150, {"actor.optimizer"}),
        (400, {"actor.optimizer", "critic.optimizer"}),
        (401, {"actor.optimizer", "critic.optimizer", "actor.grads"}),
        (600, {"actor.optimizer", "critic.optimizer", "actor.grads", "critic.grads"}),
        (601, {"actor.optimizer", "critic.optimizer", "actor.grads", "critic.grads", "ref.params"}),
        # trained params last, the actor's after the critic's
        (750, {p.name for p in PARTS} - {"actor.params"}),
        (10**6, {p.name for p in PARTS}),
    ],
)
def test_greedy_order_parks_only_what_the_need_asks_for(need, parked):
    plan = plan_offload(PARTS, need)
    assert plan.parked == parked
    assert plan.shortfall_bytes == max(0, need - sum(p.nbytes for p in PARTS))


def test_forced_keys_override_the_planner():
    parts = [
        Part("actor", "optimizer", 200, forced=False),  # kept whatever the need
        Part("actor", "grads", 100),
        Part("ref", "params", 100, forced=True),  # parked although nothing is needed
        Part("actor", "params", 100),
    ]
    assert plan_offload(parts, 0).parked == {"ref.params"}
    plan = plan_offload(parts, 150)  # ref's 100 forced bytes count: the actor's grads cover the rest
    assert plan.parked == {"ref.params", "actor.grads"}
    plan = plan_offload(parts, 500)
    assert plan.parked == {"ref.params", "actor.grads", "actor.params"} and plan.shortfall_bytes == 200
    assert "short by" in plan.log_line() and "gpu_memory_utilization" in plan.log_line()


def test_without_a_plan_the_keys_alone_decide():
    cfg = cfg_with(
        "actor_rollout_ref.actor.megatron.optimizer_offload=true", "critic.megatron.grad_offload=false"
    )
    assert config_plan(cfg).parked == {"actor.optimizer"}


# --------------------------------------------------------------------------------------------------
# Real models and the parking
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """actor + critic (trained: DDP buffers, Adam state) and ref (frozen), tiny 1-layer Llamas."""
    from megatron_rl.config import MegatronConfig
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.optim import ModelOptimizer
    from megatron_rl.parallel import destroy_parallel, init_parallel

    environ = dict(os.environ)  # init_parallel sets RANK/WORLD_SIZE/MASTER_*: keep them from later tests
    ps = init_parallel(1, 1, seed=0, device="cpu")
    hf = save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", num_hidden_layers=1)
    args = load_model_args(hf)
    models = {}
    for role in ("actor", "critic", "ref"):
        m = build_model(args, ps, "actor" if role == "ref" else role, dtype=torch.float32)
        load_hf_weights(m, hf, ps)
        models[role] = m
    optim = {
        r: ModelOptimizer(models[r], OptimConfig(lr_warmup_steps=0), MegatronConfig(), ps, total_steps=4)
        for r in ("actor", "critic")
    }
    yield SimpleNamespace(ps=ps, models=models, optim=optim)
    destroy_parallel()
    os.environ.clear()
    os.environ.update(environ)


def _plan(run, cfg, need):
    """The plan for a device that needs ``need`` more bytes for the engine (total TOTAL, no margin)."""
    engine = int(cfg.actor_rollout_ref.rollout.gpu_memory_utilization * TOTAL)
    trained = {r: (run.models[r], run.optim[r]) for r in ("actor", "critic")}
    return plan_memory(
        cfg,
        run.ps.device,
        trained,
        {"ref": run.models["ref"]},
        available=engine - need,
        total=TOTAL,
        margin=0,
    )


def _tensors(run, name):
    model, state = name.split(".")
    if state == "params":
        return list(run.models[model].parameters())
    return run.optim[model].state_tensors() if state == "optimizer" else run.optim[model].grad_tensors()


def _park(run, cfg, plan):
    """park_for_generation with ``plan``, then the actor's params as the rollout parks them after the
    weight sync; returns the parking (not reloaded)."""
    from megatron_rl.offload import HostParking
    from megatron_rl.roles.models import Models, park_for_generation

    models = Models(run.models["actor"], run.optim["actor"], run.models["ref"])
    critic = SimpleNamespace(model=run.models["critic"], optim=run.optim["critic"])  # the critic role's face
    parking = HostParking(run.ps.device)
    park_for_generation(models, critic, cfg, parking, plan)
    if plan.parks("actor", "params"):
        parking.park(run.models["actor"].parameters())
    return parking


def test_part_sizes_are_the_bytes_the_parking_frees(run):
    cfg = cfg_with()
    plan = _plan(run, cfg, 10**12)  # everything
    sizes = {p.name: p.nbytes for p in plan.parts}
    n = sum(p.numel() for p in run.models["actor"].parameters())
    # independent count: fp32 params (DDP's buffer pads a little), Adam's two moments per element
    assert n * 4 <= sizes["actor.params"] < n * 4 + 4096
    assert sizes["actor.optimizer"] == 2 * n * 4 and sizes["actor.grads"] == sizes["actor.params"]
    parking = _park(run, cfg, plan)
    assert parking.parked_bytes == plan.parked_bytes == sum(sizes.values())
    parking.reload()


@pytest.mark.parametrize("tighter", [0, 1, 2])
def test_a_budget_parks_optimizer_first_then_grads_then_params(run, tighter):
    cfg = cfg_with()
    base = _plan(run, cfg, 10**12)
    size = {p.name: p.nbytes for p in base.parts}
    opt = size["actor.optimizer"] + size["critic.optimizer"]
    need = [opt, opt + 1, opt + size["actor.grads"] + size["critic.grads"] + 1][tighter]
    expect = [
        {"actor.optimizer", "critic.optimizer"},
        {"actor.optimizer", "critic.optimizer", "actor.grads"},
        {"actor.optimizer", "critic.optimizer", "actor.grads", "critic.grads", "ref.params"},
    ][tighter]
    plan = _plan(run, cfg, need)
    assert plan.parked == expect and plan.shortfall_bytes == 0
    before = {name: [t.detach().clone() for t in _tensors(run, name)] for name in size}
    parking = _park(run, cfg, plan)
    for name in size:  # parked storages are gone, every other one is untouched
        freed = [t.untyped_storage().nbytes() == 0 for t in _tensors(run, name)]
        assert all(freed) if name in expect else not any(freed), name
    assert parking.parked_bytes == plan.parked_bytes
    parking.reload()
    for name, saved in before.items():
        now = _tensors(run, name)
        if name.endswith("grads") and name in expect:
            assert all(torch.count_nonzero(t) == 0 for t in now)  # not kept: back as zeros
        else:
            assert all(torch.equal(a, b) for a, b in zip(now, saved, strict=True)), name
    m = plan.metrics(parking.last_parked_bytes)
    assert m["perf/parked_gb"] == pytest.approx(plan.parked_bytes / 1e9)
    assert m["perf/offload/actor_optimizer"] == 1.0 and m["perf/offload/actor_params"] == 0.0


def test_forced_key_overrides_the_planner_on_real_models(run):
    cfg = cfg_with(
        "actor_rollout_ref.actor.megatron.optimizer_offload=false",
        "actor_rollout_ref.ref.megatron.param_offload=true",
    )
    size = {p.name: p.nbytes for p in _plan(run, cfg, 0).parts}
    plan = _plan(run, cfg, size["critic.optimizer"] + 1)
    # the actor's optimizer stays (forced); the forced ref params count toward the need
    assert plan.parked == {"ref.params", "critic.optimizer"}
    parking = _park(run, cfg, plan)
    assert all(t.untyped_storage().nbytes() for t in run.optim["actor"].state_tensors())
    assert parking.parked_bytes == size["ref.params"] + size["critic.optimizer"]
    parking.reload()


def test_the_one_line_log_names_the_choice(run):
    cfg = cfg_with()
    size = {p.name: p.nbytes for p in _plan(run, cfg, 0).parts}
    line = _plan(run, cfg, size["actor.optimizer"]).log_line()
    assert "\n" not in line and line.startswith("megatron-rl: memory plan:")
    assert "park actor.optimizer " in line and "keep critic.optimizer" in line and "actor.params" in line
    assert "short by" not in line


def test_on_cpu_auto_parks_nothing(run):
    cfg = cfg_with()
    trained = {r: (run.models[r], run.optim[r]) for r in ("actor", "critic")}
    plan = plan_memory(cfg, run.ps.device, trained, {"ref": run.models["ref"]})  # no budget to read
    assert plan.parked == set() and "no device budget" in plan.log_line()
    assert plan.metrics()["perf/parked_gb"] == 0.0
    # the engine keeps its memory while training (free_cache_engine=False): nothing to free either
    kept = cfg_with("actor_rollout_ref.rollout.free_cache_engine=false")
    full = plan_memory(
        kept, run.ps.device, trained, {"ref": run.models["ref"]}, available=0, total=TOTAL, margin=0
    )
    assert full.parked == set() and full.need_bytes == 0


# --------------------------------------------------------------------------------------------------
# CUDA graphs cover the rollout batch
# --------------------------------------------------------------------------------------------------


def _sglang_grid(top: int) -> list[int]:
    """SGLang's default capture sizes as its server args list them (decode, no speculative decoding)."""
    return [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, top + 1, 32)]


@pytest.mark.parametrize("bs", [1, 3, 8, 9, 12, 13, 100, 256, 257, 300, 512, 513, 700, 1024])
def test_capture_size_is_the_smallest_grid_size_that_holds_the_batch(bs):
    grid = _sglang_grid(4096)
    assert sglang_capture_grid(bs) == min(g for g in grid if g >= bs)


@pytest.mark.parametrize(
    "overrides, engines, expect",
    [
        (["data.train_batch_size=512"], 1, 512),  # the 512-prompt rollout is graph-replayed
        (["data.train_batch_size=512"], 2, 256),
        (["data.train_batch_size=64", "actor_rollout_ref.rollout.n=5"], 1, 320),
        (["data.train_batch_size=100"], 1, 104),
        (["data.train_batch_size=100"], 3, 40),  # ceil(100 / 3) = 34 rows -> 40
        (["data.train_batch_size=1024", "actor_rollout_ref.rollout.n=8"], 2, 1024),  # capped
        (["data.train_batch_size=64", "data.val_batch_size=600"], 1, 608),  # validation's batch too
    ],
)
def test_cuda_graph_max_bs_follows_the_rollout_batch_per_engine(overrides, engines, expect):
    cfg = cfg_with(*overrides)
    got = cuda_graph_max_bs(cfg, engines)
    assert got == expect
    assert got in _sglang_grid(got), "the largest size asked for is itself captured"


def test_engine_arguments_carry_the_engines_data_and_expert_parallelism():
    """rollout.data_parallel_size: SGLang's DP attention inside one engine of TP x DP ranks;
    rollout.expert_parallel_size: its ep_size; neither key is passed at 1 (SGLang's defaults)."""
    from megatron_rl.config.layout import check_expert_count
    from megatron_rl.rollout.sglang_start import engine_arguments, engine_summary

    plain = cfg_with().actor_rollout_ref.rollout
    kw = engine_arguments(plain, "/m", plain.engine_ranks, 0, 0)
    assert kw["tp_size"] == 1 and not {"dp_size", "enable_dp_attention", "ep_size"} & set(kw)
    keys = ("tensor_model_parallel_size=2", "data_parallel_size=2", "expert_parallel_size=4")
    cfg = cfg_with(*(f"actor_rollout_ref.rollout.{k}" for k in keys))
    rollout = cfg.actor_rollout_ref.rollout
    kw = engine_arguments(rollout, "/m", rollout.engine_ranks, 0, 0)
    assert (kw["tp_size"], kw["dp_size"], kw["enable_dp_attention"], kw["ep_size"]) == (4, 2, True, 4)
    assert "TP=4, DP attention=2, EP=4," in engine_summary("m", kw)
    assert rollout.engine_layout == "TP=2 x DP=2 (4 ranks), EP=4"
    check_expert_count(cfg, 8, "/moe", engine=True)
    with pytest.raises(ConfigError, match=r"rollout\.expert_parallel_size=4 does not divide the 6 experts"):
        check_expert_count(cfg, 6, "/moe", engine=True)
    with pytest.raises(ConfigError, match=r"rollout\.expert_parallel_size=4 splits routed experts, and /d"):
        check_expert_count(cfg, 0, "/d", engine=True)
    check_expert_count(cfg, 0, "/critic")  # a dense critic beside an MoE actor: the engine runs the actor


def test_engine_arguments_carry_the_graph_batch_and_respect_the_switch():
    from megatron_rl.rollout.sglang_start import engine_arguments

    cfg = cfg_with("data.train_batch_size=512").actor_rollout_ref.rollout
    kw = engine_arguments(cfg, "/m", 1, 0, 0, cuda_graph_max_bs=512)
    assert kw["cuda_graph_max_bs_decode"] == 512 and kw["disable_cuda_graph"] is False
    off = cfg_with("actor_rollout_ref.rollout.enable_cuda_graph=false").actor_rollout_ref.rollout
    kw = engine_arguments(off, "/m", 1, 0, 0, cuda_graph_max_bs=512)
    assert kw["disable_cuda_graph"] is True and "cuda_graph_max_bs_decode" not in kw
