"""Entry point: ``torchrun --nproc_per_node=N -m megatron_rl.train --config yaml/X.yaml key=value ...``

config -> validate (before any process group) -> parallel groups -> Trainer (models, engine) -> fit.
"""

from __future__ import annotations

import argparse
import logging
import os


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file (see yaml/)")
    ap.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6"
    )
    a = ap.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: never outlive it (kill -9 included)
        from megatron_rl.lifecycle import die_with_parent

        die_with_parent()

    from megatron_rl.config import load_config
    from megatron_rl.explain import explain_failures
    from megatron_rl.preflight import preflight

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    # Known failures (bad config, layout vs world size, no GPU, busy port, timeouts) end in one line
    # saying what to change; anything else keeps its traceback.
    with explain_failures():
        notices: list[str] = []
        cfg = load_config(a.config, a.overrides, notices)
        if rank == 0:
            for line in notices:  # verl keys this trainer accepts without acting on them
                print(f"megatron-rl: {line}", flush=True)
        preflight(cfg, world)
        logging.basicConfig(
            level=logging.INFO if rank == 0 else logging.WARNING,
            format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
        # Our own level, set on our logger: SGLang reconfigures the root logger when its engine starts.
        logging.getLogger("megatron_rl").setLevel(logging.INFO if rank == 0 else logging.WARNING)
        from megatron_rl.parallel import destroy_parallel, init_parallel
        from megatron_rl.trainer import Trainer

        mp = cfg.actor_rollout_ref.actor.megatron
        ps = init_parallel(
            mp.tensor_model_parallel_size,
            mp.pipeline_model_parallel_size,
            seed=mp.seed,
            device=cfg.trainer.device,
            timeout_minutes=cfg.trainer.dist_timeout_minutes,
        )
        trainer = None
        try:
            trainer = Trainer(cfg, ps)
            trainer.fit()
        finally:
            if trainer is not None:
                trainer.engine.shutdown()
            destroy_parallel()


if __name__ == "__main__":
    main()
