"""The embedded CPU demo: a tiny random Llama, the toy tokenizer and the toy dataset (toy.py).

    python -m megatron_rl.demo --out .demo
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo.yaml

Nothing is downloaded: the model (hidden 64, 2 layers) is initialised in code with HF's default
init, so the untrained policy is close to uniform and scores near chance on the toy task.
"""

from __future__ import annotations

import argparse
import os


def prepare(out: str, seed: int = 0) -> dict[str, str]:
    from megatron_rl.demo.toy import build_toy_tokenizer, make_toy_dataset
    from megatron_rl.models.random_hf import save_random_hf_model

    model_dir = os.path.join(out, "model")
    data_dir = os.path.join(out, "data")
    tok = build_toy_tokenizer(model_dir)
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        save_random_hf_model(
            model_dir,
            "llama",
            seed=seed,
            init="hf",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(tok),
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
        )
    train, test = make_toy_dataset(data_dir, n_train=4096, n_test=256, seed=seed)
    return {"model": model_dir, "train": str(train), "test": str(test)}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_rl.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default=".demo")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random model and the toy dataset")
    a = ap.parse_args()
    paths = prepare(a.out, seed=a.seed)
    print(" ".join(f"{k}={v}" for k, v in paths.items()))
