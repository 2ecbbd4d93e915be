"""Worker: the real entry point (megatron_rl.train), each rank writing what its advantage stage saw.

After every step's advantages, rank r appends to ``$SPLIT_GROUPS_OUT/rank<r>.jsonl`` one line with its
rows' uids, sequence scores (the token rewards' sum) and advantages (on each row's first response
token), so a test can recompute them on one process.
"""

import json
import os
import sys

from megatron_rl.roles import actor


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = os.environ["SPLIT_GROUPS_OUT"]
    compute = actor.Advantages.__call__

    def recorded(self, batch):
        metrics = compute(self, batch)
        row = {
            "uids": [m.uid for m in batch.meta],
            "scores": batch.token_level_rewards.sum(-1).tolist(),
            "mask": batch.response_mask[:, 0].tolist(),
            "advantages": batch.advantages[:, 0].tolist(),
        }
        with open(os.path.join(out, f"rank{os.environ['RANK']}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        return metrics

    actor.Advantages.__call__ = recorded
    from megatron_rl.train import main as train

    train(argv)


if __name__ == "__main__":
    main()
