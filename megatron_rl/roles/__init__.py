"""The roles of a PPO run, as the trainer sees them: the models of each role (``models``), the rollout
(``rollout``: colocated, or on ranks of its own through ``remote_rollout``), the critic (``critic``:
local, or on ranks of its own through ``critic_server``), and the transport between roles on ranks
of their own (``transport``). The trainer talks to roles only.
"""
