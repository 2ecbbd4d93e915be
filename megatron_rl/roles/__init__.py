"""The roles of a PPO run, as the trainer sees them, each one object with one protocol:

    actor     ActorRole: old log-probs, the update, its state; RefRole: reference log-probs;
              Advantages: KL-shaped rewards, the estimator, rejection (its KL controller's state)
    critic    CriticRole: NullCritic (GRPO and the outcome estimators) | LocalCritic | RemoteCritic
              (on ranks of its own: critic_server); calls return handles (``values_async(...).result()``)
    rollout   RolloutRole: ColocatedRollout (engine start and restarts, sampling, parking, weight sync;
              the engine alone or multi-turn episodes) | SeparateRollout (on ranks of its own:
              remote_rollout); prompts -> RolloutBatch with each row's policy version
    build     build_roles: every role built in the order memory wants; each registers its checkpoint
              state (run.state.StateRegistry) there, once
    models    the modules behind the roles and their parking during generation
    transport the wire format between roles on ranks of their own (Mailbox, pair groups; no pickle)
    sync_check  the engine's log-probs against the actor's, every trainer.sync_check_freq steps

The trainer talks to roles only.
"""
