"""Entry point: ``torchrun --nproc_per_node=N -m megatron_rl.train --config yaml/X.yaml key=value ...``

config -> validate (before any process group) -> parallel groups -> Trainer (models, engine) -> fit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file (see yaml/)")
    ap.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.actor.optim.lr=1e-6"
    )
    a = ap.parse_args(argv)

    from megatron_rl.config import ConfigError, load_config, validate

    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        cfg = load_config(a.config, a.overrides)
        validate(cfg, world_size=world)
    except ConfigError as e:
        sys.exit(f"config error: {e}")

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.trainer import Trainer

    mp = cfg.actor_rollout_ref.actor.megatron
    ps = init_parallel(
        mp.tensor_model_parallel_size,
        mp.pipeline_model_parallel_size,
        seed=mp.seed,
        device=cfg.trainer.device,
    )
    try:
        Trainer(cfg, ps).fit()
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
