"""Partial rollouts (rollout.partial_rollout) on the transformers engine: a step takes the first groups
to end, the others stop before their next turn and go on in the next step with the tokens they had
(equal to the same episodes run uninterrupted), every token stamped with the policy version that
sampled it; a group that would train too stale starts again; the batch masks carried episodes' tool
tokens as any other's; the window's slots and the checkpoint rule."""

from __future__ import annotations

import pytest

from megatron_rl.config.rollout_sections import MultiTurnConfig
from megatron_rl.demo import tools_task
from megatron_rl.roles.rollout.partial import PromptWindow, batch_of, share_of, window_state
from megatron_rl.rollout.agent.agent_loop import AgentLoop
from megatron_rl.rollout.agent.partial import release, run_window
from megatron_rl.rollout.base import SamplingParams
from tests.conftest import single_ps
from tests.unit.test_episode_async import CALL, Echo, always_calls, engine_of, items_for

# The greedy model calls the tool at every turn; the tool echoes the value, so the value's length sets
# how many turns an episode has before its 40-token budget (uninterrupted: "1" 8 turns, "1 2" 7,
# "1 2 3 4" 5, the long one 4).
SHORT, MID, LONG = "1 2 3 4 5 6 7 8", "1 2 3 4", "1 2"


@pytest.fixture(scope="module")
def tok():
    return tools_task.build_tools_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    return engine_of(always_calls(tok))


def new_loop(tok) -> AgentLoop:
    mt = MultiTurnConfig(enable=True, max_assistant_turns=8, schedule="lockstep")
    return AgentLoop(mt, single_ps(), tok, tools={"lookup": Echo()})


def params_of(tok, step: int) -> SamplingParams:
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids(CALL)]
    return SamplingParams(n=1, max_new_tokens=40, stop_token_ids=stop, greedy=True, step=step, seed=0)


def uninterrupted(tok, engine, values: list[str]):
    loop = new_loop(tok)
    items = items_for(values)
    try:
        gens = loop.run(engine, [it.prompt_ids for it in items], params_of(tok, 1), items)
    finally:
        loop.shutdown()
    return {v: g[0] for v, g in zip(values, gens, strict=True)}


def sent(values: list[str], slots: list[int]):
    items = items_for(values)
    return [(s, it.prompt_ids, it) for s, it in zip(slots, items, strict=True)]


def test_carried_episodes_keep_their_tokens_and_versions(tok, engine):
    whole = uninterrupted(tok, engine, ["1", LONG, MID, SHORT])
    loop = new_loop(tok)
    try:
        # step 1, the actor at version 0: four prompts in, two groups out -- the two that end first
        taken = run_window(
            loop, engine, sent(["1", LONG, MID, SHORT], [0, 1, 2, 3]), 2, params_of(tok, 1), 0, 1
        )
        assert [t[0] for t in taken] == [3, 2]  # SHORT ends at round 4, MID at round 5
        assert [t[2][0].token_ids for t in taken] == [whole[SHORT].token_ids, whole[MID].token_ids]
        left = {g.slot: g.episodes[0] for g in loop.window.groups.values()}
        assert sorted(left) == [0, 1]
        for e in left.values():  # stopped before their sixth turn, all of it sampled by version 0
            assert e.finish is None and e.assistant_turns == 5
            assert e.versions == [0] * len(e.tokens)
        at_stop = {s: list(e.tokens) for s, e in left.items()}

        # step 2, version 1: two new prompts; the carried ones go on from where they stopped
        taken = run_window(loop, engine, sent([SHORT, SHORT], [2, 3]), 2, params_of(tok, 2), 1, 1)
        assert [t[0] for t in taken] == [1, 0]  # LONG needs 2 more turns, "1" 3: both before the new
        for slot, value in ((1, LONG), (0, "1")):
            g = next(t[2][0] for t in taken if t[0] == slot)
            assert g.token_ids == whole[value].token_ids  # the same episode as uninterrupted
            assert g.token_ids[: len(at_stop[slot])] == at_stop[slot]
            k = len(at_stop[slot])
            assert g.versions == [0] * k + [1] * (len(g.token_ids) - k)
            # the batch masks its tool tokens as any episode's, and knows each token's version
            b = batch_of([t for t in taken if t[0] == slot], 0, 40, 2)
            n = len(g.token_ids)
            assert b.response_mask[0, :n].tolist() == [float(m) for m in g.response_mask]
            assert b.meta[0].token_versions == g.versions and b.meta[0].policy_version == 0
        new = {g.slot: g.episodes[0] for g in loop.window.groups.values()}
        assert sorted(new) == [2, 3] and all(e.assistant_turns == 3 for e in new.values())

        # step 3, version 2, a bound of 0: the groups sampled by version 1 start again from their prompt
        taken = run_window(loop, engine, sent(["1", "1"], [0, 1]), 2, params_of(tok, 3), 2, 0)
        assert [t[0] for t in taken] == [2, 3]
        for _, _, (g,) in taken:
            assert g.token_ids == whole[SHORT].token_ids and set(g.versions) == {2}
    finally:
        loop.shutdown()


def test_staleness_never_exceeds_the_bound(tok, engine):
    # every step sends its free slots' prompts: one value of each length, so groups keep carrying
    loop = new_loop(tok)
    window = PromptWindow(4)
    values = ["1", LONG, MID, SHORT]
    carried = 0
    try:
        for step in range(1, 8):
            version = step - 1
            free = [s for s in range(4) if s not in window.slots]
            window.fill([step * 10 + s for s in free])
            new = [(s, items_for([values[s]])[0].prompt_ids, items_for([values[s]])[0]) for s in free]
            window.unsent.clear()
            taken = run_window(loop, engine, new, 2, params_of(tok, step), version, 1)
            window.trained([t[0] for t in taken])
            for _, _, (g,) in taken:
                model = [v for v, m in zip(g.versions, g.response_mask, strict=True) if m]
                assert version - min(model) <= 1
                carried += min(model) < version
    finally:
        loop.shutdown()
    assert carried >= 3  # the bound was exercised: groups did carry across steps


def test_a_restarted_episode_releases_its_tools(tok, engine):
    class Counting(Echo):
        def __init__(self):
            super().__init__()
            self.released: list[str] = []

        def release(self, instance_id, **kwargs):
            self.released.append(instance_id)

    tool = Counting()
    mt = MultiTurnConfig(enable=True, max_assistant_turns=8, schedule="lockstep")
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": tool})
    try:
        run_window(loop, engine, sent(["1", SHORT], [0, 1]), 1, params_of(tok, 1), 0, 1)
        (g,) = loop.window.groups.values()
        running = g.episodes[0].instances["lookup"]
        assert len(tool.released) == 1 and running not in tool.released  # the ended one's, at its end
        loop.window.clear(lambda e: release(loop, e))  # the rule at a checkpoint
        assert tool.released[1:] == [running] and not loop.window.groups
    finally:
        loop.shutdown()


def test_the_window_fills_free_slots_and_sends_each_prompt_once():
    w = PromptWindow(5)
    assert w.draws(4) == 2  # 5 slots: two sampler batches of 4, one prompt waits in the queue
    w.fill([7, 8, 9, 10, 11, 12, 13, 14])
    assert w.slots == {0: 7, 1: 8, 2: 9, 3: 10, 4: 11} and w.queue == [12, 13, 14]
    data = {i: items_for([str(i)])[0] for i in range(7, 20)}
    assert [s for s, _, _ in w.to_send(data)] == [0, 1, 2, 3, 4] and w.to_send(data) == []
    w.trained([1, 3, 4])
    assert w.draws(4) == 0  # the queue fills the three free slots
    w.fill([])
    assert w.slots == {0: 7, 1: 12, 2: 9, 3: 13, 4: 14} and w.queue == []
    assert [s for s, _, _ in w.to_send(data)] == [1, 3, 4]
    w.trained([0, 1, 2, 3])
    assert w.draws(4) == 1
    w.resend_all()  # after a checkpoint every prompt goes again
    assert [s for s, _, _ in w.to_send(data)] == [4]


def test_a_saved_window_deals_out_at_another_dp_size():
    a, b = PromptWindow(3), PromptWindow(3)
    a.fill([5, 6, 8, 4])
    b.fill([9])
    state = window_state([a.state(), b.state()], 3)
    assert share_of(state, 1, 2, 3) == b.state()  # the same DP size: each rank its own
    assert share_of(state, 0, 1, 6) == {"slots": {}, "queue": [5, 6, 8, 9, 4]}  # one rank: all of them
    assert [share_of(state, r, 4, 2)["queue"] for r in range(4)] == [[5, 6], [8, 9], [4], []]
    c = PromptWindow(3)
    c.load(share_of(state, 0, 1, 3))
    c.fill([])
    assert c.slots == {0: 5, 1: 6, 2: 8} and c.queue == [9, 4] and c.unsent == {0, 1, 2}


PARTIAL = [
    "actor_rollout_ref.model.path=/models/x",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.partial_rollout=true",
    "actor_rollout_ref.rollout.max_staleness=1",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
]
DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


def check(*overrides: str, world: int = 2) -> None:
    from megatron_rl.config import load_config, validate

    validate(load_config(None, [*PARTIAL, *overrides]), world_size=world, model_dims=DIMS)


def test_a_partial_rollout_config_passes_and_sizes_the_window():
    from megatron_rl.config import load_config, resolve

    check()
    spec = resolve(
        load_config(None, [*PARTIAL, "actor_rollout_ref.rollout.partial_rollout_window=1.5"]), "cpu", 2
    )
    assert (spec.rollout.partial_quota, spec.rollout.partial_slots) == (4, 6) and spec.rollout.keeps_log_probs
    tight = resolve(
        load_config(None, [*PARTIAL, "actor_rollout_ref.rollout.partial_rollout_window=1.01"]), "cpu", 2
    )
    assert tight.rollout.partial_slots == 5  # at least one prompt more than a step trains on


@pytest.mark.parametrize(
    "override, names",
    [
        ("actor_rollout_ref.rollout.multi_turn.enable=false", "multi_turn.enable=true"),
        ("actor_rollout_ref.rollout.max_staleness=0", "max_staleness >= 1"),
        ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable=false"),
        ("actor_rollout_ref.rollout.partial_rollout_window=1", "partial_rollout_window"),
    ],
)
def test_what_partial_rollouts_cannot_do_is_refused_in_one_line(override, names):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        check(override)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_prompts_split_over_ranks_are_refused():
    # verl's batch rule accepts 4 prompts x 2 samples on 8 ranks; partial rollouts keep whole prompts
    from megatron_rl.config import ConfigError

    split = (
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1",
    )
    with pytest.raises(ConfigError, match="multiple of the 8 data-parallel ranks"):
        check(*split, world=8)


def test_on_rollout_ranks_of_their_own_it_is_refused():
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="leave trainer.placement.rollout unset"):
        check("trainer.placement.rollout=[2]", world=3)
