"""``python -m megatron_rl.config``: the dry run of a launch and the key reference
(:func:`megatron_rl.run.preflight.main`)."""

import sys

from megatron_rl.run.preflight import main

sys.exit(main())
