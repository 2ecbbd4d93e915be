"""``python -m megatron_rl.demo --out .demo``: prepare the CPU demo (see :mod:`megatron_rl.demo`)."""

from megatron_rl.demo import main

main()
