"""Worker (2 ranks, EP=2): a trainer checkpoint of a mixture-of-experts model in which each rank saves its
own experts (``__0_*.distcp``, ``__1_*.distcp``). The manifest lists both ranks' files; the intact
checkpoint loads; after rank 0 flips one byte of rank 1's data file, the next load is refused on both
ranks with the same line (rank 1 hashed that file, rank 0 learnt of it through the gather).

Prints ``LISTED <json>`` (rank 0), then ``rank<R> REFUSED <message>`` or ``rank<R> LOADED`` per rank.
"""

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--root", required=True)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_rl.errors import CheckpointError
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.run.checkpoint import CheckpointManager
    from megatron_rl.weights.digests import read_manifest

    ps = init_parallel(1, 1, device="cpu", ep=2)
    try:
        model = build_model(load_model_args(a.hf), ps, "actor", dtype=torch.float32)
        load_hf_weights(model, a.hf, ps)
        manager = CheckpointManager(a.root, ps, claim=True)
        path = manager.save(1, {"actor": model}, {}, {}, {"note": "x"})
        listed = sorted(read_manifest(path))
        if ps.rank == 0:
            print("LISTED", json.dumps(listed), flush=True)
        manager.load(path, {"actor": model}, {})
        dist.barrier()
        if ps.rank == 0:
            target = max(
                (f for f in listed if f.startswith("actor/__1_")),
                key=lambda f: os.path.getsize(os.path.join(path, f)),
            )
            with open(os.path.join(path, target), "r+b") as f:
                f.seek(os.path.getsize(f.name) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
        dist.barrier()
        try:
            manager.load(path, {"actor": model}, {})
            print(f"rank{ps.rank} LOADED", flush=True)
        except CheckpointError as e:
            print(f"rank{ps.rank} REFUSED {e}", flush=True)
        manager.release()
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
