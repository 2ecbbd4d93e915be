"""Rollout: the engine protocol (base.py), the reshard stream (reshard.py), and two engines:
SGLang in-process on GPU (sglang_engine.py) and transformers on CPU or GPU (hf_engine.py).

Importing this package is cheap; the engines import SGLang/transformers when they are built.
"""

from megatron_rl.rollout.base import Generation, RolloutEngine, RolloutOOMError, SamplingParams, create_engine

__all__ = ["Generation", "RolloutEngine", "RolloutOOMError", "SamplingParams", "create_engine"]
