"""``python -m megatron_rl.config``: the dry run of a launch and the key reference
(:func:`megatron_rl.preflight.main`)."""

import sys

from megatron_rl.preflight import main

sys.exit(main())
