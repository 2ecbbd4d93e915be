"""The rollout role: which prompts a step uses, its sampling parameters, the generations and the
policy version (the step whose updated weights sampled them), assembled into a RolloutBatch -- whether
the engine shares the training ranks or has ranks of its own (trainer.placement.rollout). What the loop
calls is :class:`RolloutRole`; a new kind of rollout implements it.

    rollout = ColocatedRollout(section, spec, ...)   (engine from start_engine) | SeparateRollout(...)
                                          section: actor_rollout_ref.rollout; spec: config.specs
    rollout.start(step)                   after resume: nothing | stream weights, ask ahead
    prompts = rollout.prompts(step)       the sampler's next batch | the batch asked for earlier
    rollout.sampling(step, validate)      SamplingParams of a step's rollout (or of validation)
    batch = rollout.batch(step, idx, t)   park, sync, generate, reload | wait for the engines; then
                                          the RolloutBatch, each row's meta.policy_version set here
    rollout.generate(request, ...)        one Request's generations and their version (the sync probe)
    rollout.policy_updated(step)          mark the engine stale | stream weights, ask for step+1+s
    rollout.staleness_metrics(batch)      rollout/staleness/{mean,max} against the trained version
    rollout.step_metrics(step)            offload, restarts, multi_turn/* | the engines' busy time
    rollout.register_state(registry)      the queue: generations asked for but not yet trained on
    rollout.shutdown()

Policy versions have one home: the role. Colocated, it is the version of the actor the engine syncs
from; separate, it is recorded with each step when the step is asked for, kept in the queue (and in
a checkpoint), and written into the batch's meta when the step is trained on.

    role.py         RolloutRole, Request (a train / val / sync_check rollout of a step), RolloutData,
                    sampling_params
    queue.py        RequestQueue: the asked and ready steps (checkpointed), the batch, staleness
    colocated.py    ColocatedRollout: the hybrid engine on the training ranks
    generators.py   the colocated generator, chosen once: the engine alone | multi-turn episodes
                    (the agent loop or a user's agent function, rollout/agent/)
    supervisor.py   start_engine, EngineSupervisor: a dead engine restarted in place
    partial.py      partial rollouts' window of prompts in flight (which prompt in which slot, the
                    checkpoint rule) and the batch of the groups a step trains on
    separate.py     SeparateRollout: engines on ranks of their own (roles.remote_rollout)
"""

from __future__ import annotations

from megatron_rl.roles.rollout.colocated import ColocatedRollout
from megatron_rl.roles.rollout.generators import (
    EngineGenerator,
    EpisodeGenerator,
    Generator,
    make_agent,
    make_generator,
)
from megatron_rl.roles.rollout.queue import RequestQueue
from megatron_rl.roles.rollout.role import Request, RolloutData, RolloutRole, sampling_params
from megatron_rl.roles.rollout.separate import SeparateRollout
from megatron_rl.roles.rollout.supervisor import EngineSupervisor, start_engine

__all__ = [
    "ColocatedRollout",
    "EngineGenerator",
    "EngineSupervisor",
    "EpisodeGenerator",
    "Generator",
    "Request",
    "RequestQueue",
    "RolloutData",
    "RolloutRole",
    "SeparateRollout",
    "make_agent",
    "make_generator",
    "sampling_params",
    "start_engine",
]
