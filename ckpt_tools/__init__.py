"""Offline checkpoint tools: ``python -m ckpt_tools <verb>`` (or the ``megatron-rl-ckpt`` script).

Verbs: hf-to-mcore, mcore-to-hf, legacy-to-dist, reshard, mcore-to-legacy, verify. Each converts
through the one HF<->Megatron layout mechanism (``megatron_rl.weights.tables``) and the Megatron
checkpoint readers (``megatron_rl.weights.legacy``, ``.torch_dist``) and writers (``.ckpt_write``).
Verbs that hold model shards (writing torch_dist, verify) run as TP x PP gloo processes on the CPU:
under torchrun they use its processes, otherwise they re-launch themselves under torchrun with the
needed number (see ``ckpt_tools.launch``).
"""
