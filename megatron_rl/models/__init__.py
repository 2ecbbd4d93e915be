"""Megatron-core models built from HF configs: actor, reference and critic (value head)."""
