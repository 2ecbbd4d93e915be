"""The colocated rollout's side of partial rollouts (actor_rollout_ref.rollout.partial_rollout): which
prompt sits in which slot of this DP rank's window, and a step's batch from the groups the host hands
back (the episodes themselves live on the host: rollout.agent.partial).

    window = PromptWindow(slots)          # rollout.partial_rollout_window x train_batch_size / DP slots
    window.draws(per_draw)                # sampler batches of ``per_draw`` prompts that fill the free
                                          # slots (drawn prompts no slot takes yet wait in a queue)
    window.fill(prompt_indices)           # drawn prompts into the queue, the queue into the free slots
    window.to_send(dataset)               # the prompts the host has not got: new ones, and after a
                                          # checkpoint every prompt in the window (its rule, below)
    window.trained(slots)                 # the slots of the groups a step trained on are free again

A checkpoint keeps the window's prompt indices and its queue (every DP rank's), not the episodes'
progress: at a save the host drops its groups (tools released) and every prompt of the window is sent
again at the next step, where its episodes start from scratch -- in the run that saved and in a run
resumed from that checkpoint alike, so the two stay equal.
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
        self.queue: list[int] = []
        """Drawn prompts waiting for a slot, in the sampler's order."""
        self.unsent: set[int] = set()

    def draws(self, per_draw: int) -> int:
        """Sampler batches of ``per_draw`` prompts that fill the free slots."""
        need = self.size - len(self.slots) - len(self.queue)
        return max(0, -(-need // per_draw))

    def fill(self, prompt_indices: list[int]) -> None:
        self.queue += prompt_indices
        for s in range(self.size):
            if s not in self.slots and self.queue:
                self.slots[s] = self.queue.pop(0)
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

    def state(self) -> dict:
        return {"slots": dict(self.slots), "queue": list(self.queue)}

    def load(self, state: dict) -> None:
        self.slots = {int(s): int(i) for s, i in state["slots"].items()}
        self.queue = [int(i) for i in state["queue"]]
        self.resend_all()


def window_state(parts: list[dict], size: int) -> dict:
    """The checkpoint's record: every DP rank's window (PromptWindow.state), in DP order."""
    return {"size": size, "ranks": parts}


def share_of(state: dict, dp_rank: int, dp_size: int, size: int) -> dict:
    """This DP rank's window of a saved one: its own at the same DP size and window size; else every
    saved prompt (the slots', then the queues', in DP and slot order) dealt out in contiguous shares
    into the ranks' queues (they take slots at the next step; none is lost, none taken twice)."""
    parts = state["ranks"]
    if len(parts) == dp_size and int(state["size"]) == size:
        return parts[dp_rank]
    flat = [p["slots"][s] for p in parts for s in sorted(p["slots"])] + [i for p in parts for i in p["queue"]]
    per = -(-len(flat) // dp_size)
    return {"slots": {}, "queue": flat[dp_rank * per : (dp_rank + 1) * per]}


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
