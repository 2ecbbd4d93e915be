"""megatron-rl: PPO post-training for LLMs on megatron-core.

Importing the package is cheap: megatron-core, transformers and SGLang are imported by the modules
that need them, never here.
"""

__version__ = "0.1.0"
