"""Multi-turn episodes on the rollout engine (actor_rollout_ref.rollout.multi_turn), each module imported
only when a run asks for episodes:

    agent_loop.py       the built-in loop: every episode a coroutine, its turns, tool calls and simulated
                        user (AgentLoop); episode.py an episode's state and turn encoder, tool_pool.py
                        the tool threads with timeouts, episode_stats.py the step's multi_turn/* metrics
    partial.py          partial rollouts (rollout.partial_rollout): one step's run of the episodes kept
                        in flight across steps, pool.py their groups by rank and slot
    tools.py            the tools and interactions (verl's classes and config files); tool_formats.py
                        parses the model's tool calls (hermes, llama3_json)
    agent_function.py   a user's harness (multi_turn.agent_function) driving each episode through
    openai_server.py    an OpenAI-compatible endpoint on the in-process engine; openai_http.py its
                        HTTP side, openai_request.py the checks and shape of a request and its reply
"""
