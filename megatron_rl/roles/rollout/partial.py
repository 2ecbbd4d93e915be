"""The colocated rollout's side of partial rollouts (actor_rollout_ref.rollout.partial_rollout): which
prompt sits in which slot of this DP rank's window, and a step's batch from the groups the host hands
back (the episodes themselves live on the host: rollout.agent.partial).

    window = PromptWindow(slots)          # partial_rollout_batches x train_batch_size / DP slots
    window.draws(per_draw)                # sampler batches that fill the free slots (the first step:
                                          # every slot; later: the slots trained on)
    window.fill(prompt_indices)           # into the free slots, lowest first
    window.to_send(dataset)               # the prompts the host has not got: new ones, and after a
                                          # checkpoint every prompt in the window (its rule, below)
    window.trained(slots)                 # the slots of the groups a step trained on are free again

A checkpoint keeps the window's prompt indices (every DP rank's), not the episodes' progress: at a save
the host drops its groups (tools released) and every prompt of the window is sent again at the next
step, where its episodes start from scratch -- in the run that saved and in a run resumed from that
checkpoint alike, so the two stay equal.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.batch import RolloutBatch
from megatron_rl.rollout.agent.partial import NewPrompt, Taken


class PromptWindow:
    """This DP rank's slots (the module docstring); every rank of a DP replica keeps the same."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: dict[int, int] = {}
        """slot -> prompt index (data.PromptDataset's)."""
        self.unsent: set[int] = set()

    def draws(self, per_draw: int) -> int:
        """Sampler batches of ``per_draw`` prompts that fill the free slots."""
        return (self.size - len(self.slots)) // per_draw

    def fill(self, prompt_indices: list[int]) -> None:
        free = [s for s in range(self.size) if s not in self.slots]
        if len(prompt_indices) > len(free):
            raise RuntimeError(f"partial rollouts: {len(prompt_indices)} prompts for {len(free)} free slots")
        for s, i in zip(free, prompt_indices, strict=False):
            self.slots[s] = i
            self.unsent.add(s)

    def to_send(self, dataset: Any) -> list[NewPrompt]:
        out = [(s, dataset[self.slots[s]].prompt_ids, dataset[self.slots[s]]) for s in sorted(self.unsent)]
        self.unsent.clear()
        return out

    def trained(self, slots: list[int]) -> None:
        for s in slots:
            del self.slots[s]

    def resend_all(self) -> None:
        self.unsent = set(self.slots)

    def load(self, slots: dict[int, int]) -> None:
        self.slots = {int(s): int(i) for s, i in slots.items()}
        self.resend_all()


def window_state(parts: list[dict[int, int]], size: int) -> dict:
    """The checkpoint's record: every DP rank's slots, in DP order."""
    return {"size": size, "slots": [{int(s): int(i) for s, i in p.items()} for p in parts]}


def share_of(state: dict, dp_rank: int, dp_size: int, size: int) -> dict[int, int]:
    """This DP rank's slots of a saved window: its own at the same DP size and window; else the saved
    prompts, in DP and slot order, dealt out again in contiguous shares (the window holds
    partial_rollout_batches x train_batch_size prompts at any DP size, so they fit)."""
    parts = state["slots"]
    if len(parts) == dp_size and int(state["size"]) == size:
        return dict(parts[dp_rank])
    flat = [p[s] for p in parts for s in sorted(p)]
    per = -(-len(flat) // dp_size)
    if per > size:
        raise RuntimeError(
            f"the checkpoint's partial rollouts hold {len(flat)} prompts, more than {dp_size} ranks x {size} "
            "slots: resume with the run's actor_rollout_ref.rollout.partial_rollout_batches"
        )
    return dict(enumerate(flat[dp_rank * per : (dp_rank + 1) * per]))


def batch_of(taken: Taken, pad_id: int, max_new_tokens: int, step: int) -> RolloutBatch:
    """The groups a step trains on as its batch: each row's meta.token_versions its tokens' policy
    versions and meta.policy_version the oldest of its model tokens' (what the staleness metrics and
    the bound read); uids name the step and slot, so a prompt drawn twice stays two groups."""
    items = [t[1] for t in taken]
    gens = [t[2] for t in taken]
    batch = RolloutBatch.from_generations(items, gens, pad_id, max_new_tokens, f"{step}-")
    rows = [(slot, g) for slot, _, group in taken for g in group]
    for m, (slot, g) in zip(batch.meta, rows, strict=True):
        versions = list(g.versions or [])
        model = [v for v, k in zip(versions, g.response_mask or [1] * len(versions), strict=False) if k]
        m.token_versions = versions
        m.policy_version = min(model) if model else 0
        m.uid = f"{m.uid}@{slot}"
    return batch
