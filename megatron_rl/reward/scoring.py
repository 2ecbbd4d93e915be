"""Rewards on a rollout batch, DAPO's group filter, and validation scores under verl's names.

reward_scores(batch)        the reward source (reward.source.RewardSource: rules, a custom function,
                            a reward server on the first rank of each model replica; a reward
                            model on every rank), plus
                            overlong shaping; scores [B] and the reward's extra keys broadcast to
                            the replica's TP/PP peers (a non-deterministic reward function must not
                            give the shards of one model different losses); extras land in
                            batch.meta[i].reward_extras
place_scores(batch, s)      scores on each response's last real token -> batch.token_level_scores
reward_metrics(batch)       reward/num_errors, reward/<extra key>/mean over the data-parallel group
filter_values(batch, m)     the per-sequence value algorithm.filter_groups.metric names
validation_metrics(gen)     every validation prompt once, scored into ValidationScores
ValidationScores            per data source and variable, verl's validation metrics: mean@N, and for
                            N > 1 std@N, best@k / worst@k / maj@k (bootstrap); the core variable's
                            ("acc" when the reward function returns it, else "reward") mean@N,
                            best@N and maj@N under val-core/, the rest under val-aux/
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.algos.dapo import overlong_penalty
from megatron_rl.batch import RolloutBatch
from megatron_rl.config.specs import reward_kind
from megatron_rl.errors import NonFiniteRewardError
from megatron_rl.reward.source import RewardSource

if TYPE_CHECKING:
    from megatron_rl.config import Config
    from megatron_rl.parallel import ParallelState


def make_reward_fn(
    cfg: Config, tokenizer, ps: ParallelState | None = None, reward_model=None
) -> RewardSource:
    """Where rewards come from: the reward model (``reward_model``, built by roles.build_models), a reward
    server (reward_model.http.url), or the rules / custom_reward_function."""
    from megatron_rl.reward.rules import RewardManager, load_custom_reward_function

    rm, crf = cfg.reward_model, cfg.custom_reward_function
    if reward_model is not None:
        from transformers import AutoTokenizer

        from megatron_rl.reward.model import ModelReward, reward_model_tokenizer

        actor_tok = tokenizer
        if rm.model.input_tokenizer:
            remote = cfg.actor_rollout_ref.model.trust_remote_code
            actor_tok = AutoTokenizer.from_pretrained(rm.model.input_tokenizer, trust_remote_code=remote)
        rm_tok = reward_model_tokenizer(rm.model.path, actor_tok, rm.model.trust_remote_code)
        return ModelReward(reward_model, ps, rm.micro_batch_size_per_gpu, actor_tok, rm_tok, rm.max_length)
    if rm.http.url:
        from megatron_rl.reward.http import HttpRewardManager

        return HttpRewardManager(tokenizer, rm.http)
    compute_score = load_custom_reward_function(crf.path, crf.name) if crf.path else None
    return RewardManager(tokenizer, compute_score, crf.reward_kwargs, crf.timeout_s, crf.max_error_fraction)


def reward_scores(
    reward_fn: RewardSource, batch: RolloutBatch, ps: ParallelState, cfg: Config
) -> tuple[torch.Tensor, int]:
    """Per-sequence scores [B] on ``ps.device`` (overlong shaping included) and the number of reward
    errors on this replica; sets ``meta[i].reward_extras`` on every rank of the replica. Multi-turn
    episodes: the response text includes the tool/user turns, and ``multi_turn.tool_reward_weight`` x
    the episode's tool rewards (extra_info["tool_reward"]) is added to its score.

    A score that is not finite stops the run here (:class:`NonFiniteRewardError`, naming the source,
    the row and the keys), whatever produced it: it would void the step's update."""
    lengths = batch.attention_mask[:, batch.prompts.shape[1] :].sum(-1).long().cpu()  # tool tokens too
    scores, n_err = _reward_scores(reward_fn, batch, ps, cfg, lengths)
    _check_finite(scores, batch, f"the reward ({reward_fn.name})", _source_keys(cfg))
    weight = cfg.actor_rollout_ref.rollout.multi_turn.tool_reward_weight
    if weight:
        tool = torch.tensor(
            [float(mt.extra_info.get("tool_reward", 0.0)) for mt in batch.meta], dtype=torch.float64
        )
        _check_finite(tool, batch, "the episode's tool reward", "actor_rollout_ref.rollout.multi_turn.*")
        scores = scores + (weight * tool).to(scores.device, scores.dtype)
        _check_finite(scores, batch, "the score plus tool_reward_weight x the tool reward", _WEIGHT)
    return scores, n_err


_WEIGHT = "actor_rollout_ref.rollout.multi_turn.tool_reward_weight"


_SOURCE_KEYS = {
    "model": "reward_model.model.path",
    "http": "reward_model.http.url",
    "function": "custom_reward_function.path/.name",
    "rules": "the built-in rule of the data_source (reward/rules.py)",
}


def _source_keys(cfg: Config) -> str:
    """The config keys of the reward source in use (config.specs.reward_kind), for error lines."""
    return _SOURCE_KEYS[reward_kind(cfg)]


def _check_finite(values: torch.Tensor, batch: RolloutBatch, what: str, keys: str) -> None:
    """A NonFiniteRewardError naming the first row of ``values`` [B] that is NaN or infinite."""
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise NonFiniteRewardError(
            f"{what} is {float(values[i])} for row {i} (uid {batch.meta[i].uid!r}, data_source "
            f"{batch.meta[i].data_source!r}; {len(bad)} rows in all); a reward must be a finite number: "
            f"look at {keys}"
        )


def _reward_scores(
    reward_fn: RewardSource,
    batch: RolloutBatch,
    ps: ParallelState,
    cfg: Config,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    if reward_fn.collective:  # a reward model: every rank runs its forward
        out = reward_fn.score_batch(batch, lengths)
        scores, extras = _overlong_shaped(out.scores.float().cpu(), dict(out.extras), lengths, cfg)
        for i, mt in enumerate(batch.meta):
            mt.reward_extras = {k: float(v[i]) for k, v in extras.items()}
        return scores.to(ps.device), out.num_errors
    keys: list[str] = []
    packed, preds = None, None
    if ps.is_dp_leader:
        out = reward_fn.score_batch(batch, lengths)
        preds = out.preds
        scores, extras = _overlong_shaped(out.scores, dict(out.extras), lengths, cfg)
        keys = sorted(extras)
        # [B + 1, 1 + K]: scores and the extras per row; the error count in the last row.
        packed = torch.zeros(len(batch) + 1, 1 + len(keys))
        packed[:-1, 0] = scores
        for j, k in enumerate(keys):
            packed[:-1, 1 + j] = extras[k]
        packed[-1, 0] = out.num_errors
    if ps.tp_size * ps.pp_size > 1:
        src = dist.get_global_rank(ps.mp_group, 0)
        box = [keys, preds]
        dist.broadcast_object_list(box, src=src, group=ps.mp_group)
        keys, preds = box
        if packed is None:
            packed = torch.zeros(len(batch) + 1, 1 + len(keys))
        packed = packed.to(ps.device)
        dist.broadcast(packed, src=src, group=ps.mp_group)
    packed = packed.cpu()
    for i, mt in enumerate(batch.meta):
        mt.reward_extras = {
            k: float(packed[i, 1 + j]) for j, k in enumerate(keys) if not math.isnan(packed[i, 1 + j])
        }
        mt.pred = None if preds is None else preds[i]
    return packed[:-1, 0].to(ps.device), int(packed[-1, 0].item())


def _overlong_shaped(
    scores: torch.Tensor, extras: dict[str, torch.Tensor], lengths: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """reward_model.overlong_buffer: the penalty added to the scores [B] (and logged as extras)."""
    ob = cfg.reward_model.overlong_buffer
    if not ob.enable:
        return scores, extras
    penalty = overlong_penalty(lengths, cfg.data.max_response_length, ob.len, ob.penalty_factor)
    if ob.log:
        extras = {**extras, "overlong_reward": penalty, "overlong": (penalty < 0).float()}
    return scores + penalty, extras


def place_scores(batch: RolloutBatch, scores: torch.Tensor) -> None:
    """Each score on its response's last trained token (the model's last; in a multi-turn episode
    tool tokens may follow it): batch.token_level_scores [B, R]."""
    mask = batch.response_mask
    cols = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, cols, -1).amax(-1)  # [B]; -1: nothing trained on
    token_scores = torch.zeros_like(mask)
    token_scores[torch.arange(len(batch), device=last.device), last.clamp(min=0)] = scores * (last >= 0)
    batch.token_level_scores = token_scores


def _union_keys(local: set[str], group) -> list[str]:
    """The union over ``group`` of each rank's keys (every rank must log the same metric names)."""
    if group is None or dist.get_world_size(group) == 1:
        return sorted(local)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(local), group=group)
    return sorted({k for ks in gathered for k in ks})


def reward_metrics(batch: RolloutBatch, num_errors: int, ps: ParallelState) -> dict[str, float]:
    """``reward/num_errors`` (summed over DP) and ``reward/<key>/mean`` of the reward's extra keys."""
    keys = _union_keys({k for mt in batch.meta for k in mt.reward_extras}, ps.dp_group)
    # [errors, (sum, count) per key]
    stats = torch.zeros(1 + 2 * len(keys), dtype=torch.float64)
    stats[0] = num_errors
    for mt in batch.meta:
        for j, k in enumerate(keys):
            if k in mt.reward_extras:
                stats[1 + 2 * j] += mt.reward_extras[k]
                stats[2 + 2 * j] += 1
    stats = stats.to(ps.device)
    dist.all_reduce(stats, group=ps.dp_group)
    stats = stats.tolist()
    out = {"reward/num_errors": stats[0]}
    for j, k in enumerate(keys):
        out[f"reward/{k}/mean"] = stats[1 + 2 * j] / max(stats[2 + 2 * j], 1.0)
    return out


def filter_values(batch: RolloutBatch, metric: str | None) -> torch.Tensor:
    """[B] values whose spread within a prompt group decides whether DAPO keeps the group.

    seq_reward / score: the sequence score (shaping included); seq_final_reward: the token rewards'
    sum; acc (the default) or any other name: that key of the reward function's result, where "acc"
    falls back to the score for reward functions that return a number.
    """
    metric = metric or "acc"
    if metric in ("seq_reward", "score"):
        return batch.token_level_scores.sum(-1).cpu()
    if metric == "seq_final_reward":
        rewards = (
            batch.token_level_rewards if batch.token_level_rewards is not None else batch.token_level_scores
        )
        return rewards.sum(-1).cpu()
    values = []
    for i, mt in enumerate(batch.meta):
        if metric in mt.reward_extras:
            values.append(mt.reward_extras[metric])
        elif metric == "acc":
            values.append(float(batch.token_level_scores[i].sum()))
        else:
            raise ValueError(
                f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such key for "
                f"data_source={mt.data_source!r} (keys: {sorted(mt.reward_extras)}); use acc, score, "
                "seq_reward, seq_final_reward or a key the reward function returns."
            )
    return torch.tensor(values, dtype=torch.float64)


_N_BOOTSTRAP = 1000
"""Bootstrap draws per subset size (verl: process_validation_metrics' n_bootstrap)."""
_BOOTSTRAP_SEED = 42
"""verl's seed for every bootstrap draw (process_validation_metrics' default, which _validate keeps)."""


def bootstrap_sizes(n: int) -> list[int]:
    """verl's subset sizes k for best@k / worst@k / maj@k with n samples per prompt: the powers of two
    from 2 below n, then n itself (n=4: [2, 4]; n=5: [2, 4, 5]); none for n = 1."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def _metric_names(n: int) -> list[str]:
    """The per-variable metric names for n samples per prompt, in verl's order."""
    names = [f"mean@{n}"]
    if n > 1:
        names.append(f"std@{n}")
    for k in bootstrap_sizes(n):
        names += [f"{stat}@{k}/{part}" for stat in ("best", "worst", "maj") for part in ("mean", "std")]
    return names


class ValidationScores:
    """Accumulates validation samples; ``metrics()`` reduces over DP under verl's names.

    Each prompt's n samples give, per variable (``reward`` and every extra key of the reward), verl's
    per-prompt statistics; a metric is the mean over prompts of its per-prompt values:

    mean@n                  the mean of the n values
    std@n                   (n > 1) their population std
    best@k/mean, /std       (n > 1, k in bootstrap_sizes(n)) over 1000 bootstrap subsets of k of the n
    worst@k/mean, /std      samples drawn with replacement: the mean and population std of the
                            subsets' max (best) or min (worst)
    maj@k/mean, /std        (when the prompt's samples all carry a "pred" key: a number, or any
                            hashable such as a string answer) the same over the value of the majority
                            vote on "pred": the subset's most frequent pred (equal as dict keys are),
                            ties going to the pred drawn first; the vote's value is the variable's
                            value at that pred's first draw. A string pred is not a variable itself.

    The draws reproduce verl's: before each bootstrap verl seeds numpy's global legacy RNG with 42 and
    takes ``np.random.choice(n, size=(1000, k), replace=True)``; an own ``np.random.RandomState(42)``
    makes the same draws (so the same subsets for every prompt and variable) without touching numpy's
    global state. Per-prompt values equal verl's bit for bit; the mean over prompts sums them on each
    data-parallel rank and all-reduces the sums, so it equals verl's np.mean to float64 rounding.

    val-core holds the core variable's (``acc`` when the data source's reward returns it, else
    ``reward``) mean@n, best@n/* and maj@n/*; everything else is under val-aux. A prompt whose samples
    do not all carry a variable (an extra key missing on some) counts in that variable's mean@n / std@n
    over the samples that have it, and in none of its bootstrap metrics.
    """

    def __init__(self, n: int, n_bootstrap: int = _N_BOOTSTRAP, seed: int = _BOOTSTRAP_SEED) -> None:
        self.n = n
        self._order = {name: i for i, name in enumerate(_metric_names(n))}
        # k -> [n_bootstrap, k] sample indices of each subset; verl re-seeds before each draw, so they
        # are the same for every prompt and variable.
        self.draws: dict[int, np.ndarray] = {
            k: np.random.RandomState(seed).choice(n, size=(n_bootstrap, k), replace=True)
            for k in bootstrap_sizes(n)
        }
        # (source, var, metric) -> [sum over prompts of the per-prompt value, prompts]
        self.sums: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])

    def add(self, batch: RolloutBatch, scores: torch.Tensor, real_rows: int) -> None:
        """Rows 0..real_rows-1 of ``batch`` (n adjacent samples per prompt) with their scores [B]."""
        row_scores: list[float] = scores.cpu().tolist()
        for start in range(0, real_rows, self.n):
            rows = range(start, start + self.n)
            source = batch.meta[start].data_source
            variables: dict[str, list[float]] = {"reward": [row_scores[i] for i in rows]}
            for i in rows:
                for k, v in batch.meta[i].reward_extras.items():
                    variables.setdefault(k, []).append(v)
            # maj@k: every sample carries a pred, a string one (meta.pred) or a number (an extra)
            metas = [batch.meta[i] for i in rows]
            preds = [m.reward_extras.get("pred") if m.pred is None else m.pred for m in metas]
            voted = all(p is not None for p in preds)
            winners = self._majority(preds) if voted else None
            for var, values in variables.items():
                per_prompt = self._prompt_metrics(np.asarray(values, dtype=np.float64), winners)
                for name, value in per_prompt.items():
                    acc = self.sums[source, var, name]
                    acc[0] += value
                    acc[1] += 1

    def _majority(self, preds: list) -> dict[int, np.ndarray]:
        """k -> [n_bootstrap] the sample whose value each subset's majority vote on ``preds`` (n hashables)
        reports."""
        ids: dict = {}  # each pred -> one id, keys equal as verl's vote dict has them (1 == 1.0 == True)
        votes_of = np.asarray([ids.setdefault(p, len(ids)) for p in preds])
        same = votes_of[:, None] == votes_of[None, :]  # [n, n]
        winners = {}
        for k, idx in self.draws.items():
            # [n_bootstrap, k]: how many draws of its subset share each draw's pred
            votes = same[idx[:, :, None], idx[:, None, :]].sum(-1)
            # The first draw with the most votes is the first draw of the pred that appeared first among
            # the most voted ones: verl's tie-break (the first key of an insertion-ordered dict), and the
            # draw whose value it reports.
            first = votes.argmax(-1)  # [n_bootstrap]
            winners[k] = idx[np.arange(len(idx)), first]
        return winners

    def _prompt_metrics(self, values: np.ndarray, winners: dict[int, np.ndarray] | None) -> dict[str, float]:
        """verl's per-prompt statistics of one variable's values [m] (m = n unless some samples lack it)."""
        out = {f"mean@{self.n}": float(np.mean(values))}
        if self.n == 1:
            return out
        out[f"std@{self.n}"] = float(np.std(values))
        if len(values) != self.n:
            return out
        for k, idx in self.draws.items():
            drawn = values[idx]  # [n_bootstrap, k]
            for stat, per_subset in (("best", drawn.max(-1)), ("worst", drawn.min(-1))):
                out[f"{stat}@{k}/mean"] = float(np.mean(per_subset))
                out[f"{stat}@{k}/std"] = float(np.std(per_subset))
            if winners is not None:
                maj = values[winners[k]]  # [n_bootstrap]
                out[f"maj@{k}/mean"] = float(np.mean(maj))
                out[f"maj@{k}/std"] = float(np.std(maj))
        return out

    def _stats(self, keys: list[str]) -> torch.Tensor:
        """[K, 2] float64: this rank's (sum, prompts) for each "source\\tvar\\tmetric" key."""
        return torch.tensor([self.sums.get(_key(k), [0.0, 0.0]) for k in keys], dtype=torch.float64).reshape(
            len(keys), 2
        )

    def _named(self, keys: list[str], stats: torch.Tensor) -> dict[str, float]:
        """The DP-reduced ``stats`` [K, 2] of ``keys`` under verl's val-core / val-aux names."""
        triples = [tuple(k.split("\t")) for k in keys]
        has_acc = {s for s, v, _ in triples if v == "acc"}
        rows = sorted(
            zip(triples, stats.tolist(), strict=True),
            key=lambda r: (r[0][0], r[0][1], self._order.get(r[0][2], len(self._order))),
        )
        out: dict[str, float] = {}
        for (source, var, name), (total, prompts) in rows:
            k = int(name.split("@")[1].split("/")[0])
            core_var = "acc" if source in has_acc else "reward"
            core = var == core_var and name.startswith(("mean", "best", "maj")) and k == self.n
            section = "val-core" if core else "val-aux"
            out[f"{section}/{source}/{var}/{name}"] = total / max(prompts, 1.0)
        return out

    def metrics(self, ps: ParallelState) -> dict[str, float]:
        keys = _union_keys({"\t".join(k) for k in self.sums}, ps.dp_group)
        if not keys:
            return {}
        stats = self._stats(keys).to(ps.device)
        if ps.dp_group is not None:  # None: a single process (nothing to reduce)
            dist.all_reduce(stats, group=ps.dp_group)
        return self._named(keys, stats.cpu())


def validation_metrics(
    generate: Callable[[list[int]], RolloutBatch],
    reward_fn: RewardSource,
    n_val: int,
    ps: ParallelState,
    cfg: Config,
) -> dict[str, float]:
    """Generation with val_kwargs on every validation prompt once (``generate(indices)``: the rollout
    role's validation batch), scored under verl's names: val-core/<data_source>/reward/mean@<n>
    (``acc`` instead of ``reward`` when the reward function returns it; for n > 1 also its best@n and
    maj@n), its other keys, std@n and the other bootstrap metrics under val-aux/ (:class:`ValidationScores`).

    Rank r of the data-parallel group takes prompts r, r + dp, ...; every rank runs the same number
    of batches of the same size (the engine's generate is collective), a short last batch is filled
    with a repeated prompt whose scores are not counted.
    """
    mine = list(range(ps.dp_rank, n_val, ps.dp_size))
    per_rank = -(-n_val // ps.dp_size)
    bs = max(1, (cfg.data.val_batch_size or n_val) // ps.dp_size)
    scores = ValidationScores(cfg.actor_rollout_ref.rollout.val_kwargs.n)
    for start in range(0, per_rank, bs):
        idx = mine[start : start + bs]
        real = len(idx) * scores.n
        idx += [0] * (min(bs, per_rank - start) - len(idx))
        batch = generate(idx)
        scores.add(batch, reward_scores(reward_fn, batch, ps, cfg)[0], real)
    return scores.metrics(ps)


def _key(joined: str) -> tuple[str, str, str]:
    """A "source\tvar\tmetric" key back into its three parts."""
    source, var, metric = joined.split("\t")
    return source, var, metric
