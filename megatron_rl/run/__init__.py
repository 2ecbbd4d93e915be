"""What a run needs around the maths: checkpoints (``checkpoint``, ``ckpt_files``), metrics and their
sinks (``metrics``, ``plot``), FLOPs and MFU (``perf``), stop signals (``lifecycle``), the checks made
before any model is built (``preflight``, ``launch_checks``, ``ports``) and the messages that explain a
failure (``explain``). Nothing here knows a role: roles and the trainer use these.
"""
