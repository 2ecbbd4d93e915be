"""Worker: the real entry point (megatron_rl.train) under torchrun."""

import sys

from megatron_rl.train import main

if __name__ == "__main__":
    main(sys.argv[1:])
