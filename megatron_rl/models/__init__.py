"""Megatron-core models built from HF configs: actor, reference and critic (value head)."""

from megatron_rl.parallel import load_torch_cudnn

# before any module here imports megatron-core, whose import loads Transformer Engine (and with it a
# cuDNN of TE's finding): scripts and tools that build models without init_parallel come through here
load_torch_cudnn()
