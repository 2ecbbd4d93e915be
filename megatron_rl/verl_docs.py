"""Write docs/verl_compat.md: every verl key with what this project does with it.

    python -m megatron_rl.verl_docs > docs/verl_compat.md

The table is :func:`megatron_rl.verl_compat.compat_table` over verl's keys (``verl_keys.txt``) and
this project's config keys; it lives above :mod:`megatron_rl.config`, which applies the translation.
"""

from __future__ import annotations

from megatron_rl.config import Config, known_keys
from megatron_rl.verl_compat import compat_table, verl_key_list


def main() -> None:
    print(compat_table(list(verl_key_list()), set(known_keys(Config))))


if __name__ == "__main__":
    main()
