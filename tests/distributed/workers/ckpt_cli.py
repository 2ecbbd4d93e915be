"""Worker (2 ranks): ckpt_tools verbs (hf-to-mcore, reshard, legacy-to-dist, verify) run one after another
inside one torchrun job.

The job starts torch.distributed itself; each verb builds megatron's groups for its own TP/PP in
that world and leaves the process group up for the next one. Rank 0 writes {step: exit code}.
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--legacy", required=True, help="legacy TP2 x PP2 checkpoint")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch.distributed as dist

    from ckpt_tools.__main__ import main as cli

    dist.init_process_group("gloo")
    m, m2, d = f"{a.work}/mcore_tp2", f"{a.work}/mcore_pp2", f"{a.work}/from_legacy"
    steps = {
        "hf_to_mcore": ["hf-to-mcore", "--hf", a.hf, "--out", m, "--tp", "2", "--pp", "1"],
        "reshard": ["reshard", "--ckpt", m, "--out", m2, "--tp", "1", "--pp", "2"],
        "legacy_to_dist": ["legacy-to-dist", "--legacy", a.legacy, "--out", d, "--tp", "2", "--pp", "1"],
        "verify_resharded_pp2": ["verify", "--hf", a.hf, "--ckpt", m2, "--pp", "2", "--tol", "1e-4"],
        "verify_from_legacy_tp2": ["verify", "--hf", a.hf, "--ckpt", d, "--tp", "2", "--tol", "1e-4"],
    }
    rcs = {name: cli(argv) for name, argv in steps.items()}
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(rcs, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
