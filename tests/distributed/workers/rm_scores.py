"""Worker: reward-model scores (``compute_rm_scores``) at one TP x PP layout, for several architectures.

Per architecture (``--models NAME=HF_SEQ_CLS_DIR ...``), with the same global batches at every layout:

1. build ``role="reward"`` and load the HF ``...ForSequenceClassification`` directory; score a
   right-padded batch (HF's convention, pad_token_id) and a left-padded one (7 sequences of 1..9 tokens,
   micro-batches of 2: the last one is filled up). Each data-parallel rank scores its rows
   (``rows[dp_rank::dp_size]``); the scores are gathered back into batch order.
2. negative controls through the same code: the score of the token before the last (attention mask cut
   by one, which under causal attention is the output at the previous position) and a permuted score
   head (hidden dimension reversed);
3. at TP > 1, the same with sequence parallelism (S = 9 is padded to a multiple of TP);
4. ``--save-td ROOT``: save the reward model as torch_dist into ROOT/NAME; ``--load-td ROOT``: build the
   architecture from ROOT/NAME (``load_model_args_any``), load it (``load_weights``) and score again;
   an actor must refuse that checkpoint.

Rank 0 checks against HF's ``logits[:, 0]`` and writes --out/NAME.json. Heavy imports live inside
main(): dist_checkpointing spawns a helper process that re-imports this module.
"""

import argparse
import json
import os

B, S, MICRO = 7, 9, 2
LENGTHS = [9, 1, 5, 3, 8, 2, 6]  # real tokens per sequence


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True, help="NAME=HF_SEQ_CLS_DIR")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-td", help="save each reward model as torch_dist into ROOT/NAME")
    ap.add_argument("--load-td", help="also load each reward model from the torch_dist ROOT/NAME")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.loading import load_model_args_any, load_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.reward.model import compute_rm_scores
    from megatron_rl.weights.ckpt_write import save_torch_dist

    ps = init_parallel(a.tp, a.pp, seed=1, device="cpu")
    os.makedirs(a.out, exist_ok=True)

    def batches(vocab: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{"right": (ids, mask), "left": (ids, mask)}: the same tokens (never the pad id 0), 0-padded."""
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(3, vocab, (B, S), generator=g)
        n = torch.tensor(LENGTHS)[:, None]
        pos = torch.arange(S)[None]
        right = pos < n
        left = pos >= S - n
        left_tok = torch.stack([torch.roll(t, S - k) for t, k in zip(tok, LENGTHS, strict=True)])
        return {
            "right": (torch.where(right, tok, 0), right.long()),
            "left": (torch.where(left, left_tok, 0), left.long()),
        }

    def scores(model, ids, mask) -> torch.Tensor:
        """This DP rank's rows scored, gathered over DP into batch order: [B] on every rank."""
        mine = list(range(ps.dp_rank, B, ps.dp_size))
        local = compute_rm_scores(model, ps, ids[mine], mask[mine], MICRO)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (ps.dp_rank, local.tolist()))
        out = torch.empty(B)
        for dp_rank, vals in parts:
            out[list(range(dp_rank, B, ps.dp_size))] = torch.tensor(vals)
        return out

    def same_on_every_rank(x: torch.Tensor) -> float:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return max((p - x).abs().max().item() for p in parts)

    for spec in a.models:
        name, path = spec.split("=")
        args = load_model_args(path)
        data = batches(args.vocab_size)
        res: dict = {"layout": {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size}}
        got: dict[str, torch.Tensor] = {}

        model = build_model(args, ps, role="reward")
        load_hf_weights(model, path, ps)
        for kind, (ids, mask) in data.items():
            got[kind] = scores(model, ids, mask)
        res["rank_spread"] = same_on_every_rank(got["right"])
        # negative control 1: the token before the last (rows of one token keep theirs)
        ids, mask = data["right"]
        shorter = mask.clone()
        shorter[torch.arange(B), torch.tensor(LENGTHS) - 1] = torch.tensor([int(k == 1) for k in LENGTHS])
        got["wrong_position"] = scores(model, ids, shorter)
        # negative control 2: a permuted score head
        if ps.is_last_stage:
            with torch.no_grad():
                model.output_layer.weight.copy_(model.output_layer.weight.flip(-1))
        got["permuted_head"] = scores(model, ids, mask)
        if ps.tp_size > 1:
            sp = build_model(args, ps, role="reward", options=TrainingOptions(sequence_parallel=True))
            load_hf_weights(sp, path, ps)
            got["sequence_parallel"] = scores(sp, *data["right"])
        if a.save_td:
            model = build_model(args, ps, role="reward")
            load_hf_weights(model, path, ps)
            save_torch_dist(model, ps, os.path.join(a.save_td, name))
        if a.load_td:
            td = os.path.join(a.load_td, name)
            td_args = load_model_args_any(td)
            res["td_args_equal"] = td_args == args
            model = build_model(td_args, ps, role="reward")
            res["td_format"] = load_weights(model, td, ps)
            got["torch_dist"] = scores(model, *data["right"])
            actor = build_model(td_args, ps, role="actor")
            try:
                load_weights(actor, td, ps)
                res["actor_refused"] = ""
            except ValueError as e:
                res["actor_refused"] = str(e)

        if ps.rank == 0:
            from transformers import AutoModelForSequenceClassification

            hf = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            with torch.no_grad():
                ref = {k: hf(input_ids=i, attention_mask=m).logits[:, 0] for k, (i, m) in data.items()}
            res["max_abs_score"] = ref["right"].abs().max().item()
            res["score_spread"] = ref["right"].std().item()
            for key, val in got.items():
                want = ref["left"] if key == "left" else ref["right"]
                res[f"diff_{key}"] = (val - want).abs().max().item()
            res["scores"] = {k: v.tolist() for k, v in got.items()}
            res["hf_scores"] = {k: v.tolist() for k, v in ref.items()}
            with open(os.path.join(a.out, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=2)
        dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    main()
