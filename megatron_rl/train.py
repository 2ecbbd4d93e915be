"""Entry point: ``torchrun --nproc_per_node=N -m megatron_rl.train --config yaml/X.yaml key=value ...``

config -> validate (before any process group) -> parallel groups -> Trainer (models, engine) -> fit;
with trainer.placement.rollout (or .critic) on ranks of their own, those ranks serve generations
(or values and critic updates) to the actor's ranks instead.
"""

from __future__ import annotations

import argparse
import logging
import os


def hide_known_benign_warnings() -> None:
    """Filter, by message and module, the warnings a correct run raises on every start or resume; each
    entry says why it is benign. Anything else still shows."""
    import warnings

    # megatron-core's distributed optimizer keeps the shards of fp32 parameters as views of them
    # (non-leaf tensors) and assigns their .grad itself; its zero_grad reads that attribute, which torch
    # flags for any non-leaf tensor. The gradients are right (tests/distributed/test_ppo_layouts.py
    # compares every layout's update with the unsharded run's).
    warnings.filterwarnings(
        "ignore",
        message=r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        category=UserWarning,
        module=r"megatron\.core\.optimizer\.optimizer",
    )
    # Loading a torch_dist checkpoint (every resume): megatron-core 0.16.1's strategy calls torch's
    # load_state_dict and builds ShardedTensors, APIs torch deprecates; the checkpoint format is theirs,
    # the warnings are addressed to megatron-core, not to the run.
    warnings.filterwarnings(
        "ignore",
        message=r"`load_state_dict` is deprecated and will be removed in future versions",
        category=FutureWarning,
        module=r"megatron\.core\.dist_checkpointing\.strategies\.torch",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning,
        module=r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)",
    )


def main(argv: list[str] | None = None) -> None:
    hide_known_benign_warnings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file (see yaml/)")
    ap.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6"
    )
    import sys

    from megatron_rl.verl_compat import hydra_config_args

    hydra_notices: list[str] = []  # Hydra's --config-path/--config-name, as verl's scripts pass them
    a = ap.parse_args(hydra_config_args(list(sys.argv[1:] if argv is None else argv), hydra_notices))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: never outlive it (kill -9 included)
        from megatron_rl.run.lifecycle import die_with_parent

        die_with_parent()

    from megatron_rl.config import load_config
    from megatron_rl.optim import precision_notices
    from megatron_rl.run.explain import explain_failures
    from megatron_rl.run.preflight import preflight

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    # Known failures (bad config, layout vs world size, no GPU, busy port, timeouts) end in one line
    # saying what to change; anything else keeps its traceback.
    with explain_failures():
        notices: list[str] = hydra_notices
        typed: dict = {}  # values as the user wrote them, where verl_compat rewrote them
        cfg = load_config(a.config, a.overrides, notices, typed)
        notices += precision_notices(cfg)
        if rank == 0:
            for line in notices:  # verl keys this trainer accepts without acting on them
                print(f"megatron-rl: {line}", flush=True)
        preflight(cfg, world, typed=typed)
        from megatron_rl.config.layout import expert_layout
        from megatron_rl.config.placement import resolve_placement
        from megatron_rl.parallel import destroy_parallel, init_parallel

        placement = resolve_placement(cfg, world)
        if rank == 0 and os.environ.get("MEGATRON_RL_REPLACED"):  # set by launch/torchrun.sh after SIGUSR1
            print(f"megatron-rl: placement after the restart: {placement.describe()}", flush=True)
        lead = rank == placement.actor[0]  # rank 0 of the training ranks speaks for the job
        logging.basicConfig(
            level=logging.INFO if lead else logging.WARNING,
            format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        # Our own level, set on our logger: SGLang reconfigures the root logger when its engine starts.
        logging.getLogger("megatron_rl").setLevel(logging.INFO if lead else logging.WARNING)
        # a rank of a role on ranks of its own serves the actor's ranks (Placement.role_of decides)
        server = {"rollout": serve_rollout, "critic": serve_critic}.get(placement.role_of(rank))
        if server is not None:
            try:
                server(cfg, placement)
            finally:
                destroy_parallel()
            return
        from megatron_rl.trainer import Trainer

        mp = cfg.actor_rollout_ref.actor.megatron
        ep, etp = expert_layout(mp)
        ps = init_parallel(
            mp.tensor_model_parallel_size,
            mp.pipeline_model_parallel_size,
            ep=ep,
            etp=etp,
            seed=mp.seed,
            device=cfg.trainer.device,
            timeout_minutes=cfg.trainer.dist_timeout_minutes,
            ranks=placement.actor,
        )
        trainer = None
        try:
            trainer = Trainer(cfg, ps, placement)
            trainer.fit()
        finally:
            if trainer is not None:
                trainer.roles.shutdown()
            destroy_parallel()


def serve_rollout(cfg, placement) -> None:
    """A rollout rank of a separate-rollout placement: start the engine, serve the training ranks until
    they say stop. Stop signals are left to the training ranks, which end the job after their step."""
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.parallel import init_parallel
    from megatron_rl.roles.remote_rollout import RolloutServer
    from megatron_rl.rollout import create_engine
    from megatron_rl.run.lifecycle import PreemptionWatch
    from megatron_rl.run.memory_plan import cuda_graph_max_bs

    arr = cfg.actor_rollout_ref  # SGLang without a GPU: rollout.check_engine_device
    ps = init_parallel(
        arr.rollout.engine_ranks,  # megatron's TP groups are the engines' groups
        1,
        seed=arr.actor.megatron.seed,
        device=cfg.trainer.device,
        timeout_minutes=cfg.trainer.dist_timeout_minutes,
        ranks=placement.rollout,
    )
    args = load_model_args_any(arr.model.path)
    graph_bs = cuda_graph_max_bs(cfg, ps.world_size // arr.rollout.tensor_model_parallel_size)
    engine = create_engine(
        arr.rollout, arr.model.path, args, ps, seed=arr.rollout.seed, cuda_graph_max_bs=graph_bs
    )
    try:
        with PreemptionWatch():
            ranks, minutes = arr.rollout.engine_ranks, cfg.trainer.dist_timeout_minutes
            RolloutServer(engine, args, ps, placement, ranks, minutes).serve()
    finally:
        engine.shutdown()


def serve_critic(cfg, placement) -> None:
    """A critic rank of a placement that gives the critic ranks of its own: megatron's groups over the
    critic's ranks, then values and updates for the actor's ranks until they say stop."""
    from megatron_rl.config.layout import expert_layout
    from megatron_rl.parallel import init_parallel
    from megatron_rl.roles.critic_server import CriticServer
    from megatron_rl.run.checkpoint import write_in_process
    from megatron_rl.run.lifecycle import PreemptionWatch

    write_in_process()  # its saves start no helper process that a stop signal to the group would kill

    mp = cfg.critic.megatron
    ep, etp = expert_layout(mp, cfg.actor_rollout_ref.actor.megatron)
    ps = init_parallel(
        mp.tensor_model_parallel_size,
        mp.pipeline_model_parallel_size,
        ep=ep,
        etp=etp,
        seed=cfg.actor_rollout_ref.actor.megatron.seed,
        device=cfg.trainer.device,
        timeout_minutes=cfg.trainer.dist_timeout_minutes,
        ranks=placement.critic,
    )
    arr = cfg.actor_rollout_ref
    with PreemptionWatch():  # stop signals are the actor's ranks' to act on
        CriticServer(cfg, ps, side_file_dirs=(cfg.data.tokenizer, arr.model.path)).serve()


if __name__ == "__main__":
    main()
