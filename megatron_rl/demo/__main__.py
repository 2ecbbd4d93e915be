"""``python -m megatron_rl.demo --out .demo``: prepare the CPU demo (see :mod:`megatron_rl.demo`);
``python -m megatron_rl.demo tools --out .demo/tools``: the tool-calling demo (demo/tools_task.py)."""

import sys

if sys.argv[1:2] == ["tools"]:
    del sys.argv[1]
    from megatron_rl.demo.tools_task import main
else:
    from megatron_rl.demo import main

main()
