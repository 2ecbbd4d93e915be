"""mypy over the whole package, held to a baseline that may only shrink (``make lint``).

    python tests/mypy_baseline.py            check: no file has more errors than its baseline
    python tests/mypy_baseline.py --update   write the baseline from today's errors (after fixing some)

``[tool.mypy] files`` in pyproject.toml (the typed core) must be clean: ``make lint`` runs mypy on it
as well. The rest of the package is checked here file by file against tests/mypy_baseline.json
(file -> errors): a file over its number fails with its new errors listed; a file under it asks for
the baseline to be lowered, so that the number follows the fixes down.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "mypy_baseline.json"
ERROR = re.compile(r"^(?P<file>[^:]+\.py):\d+: error: ")


def errors() -> tuple[Counter, list[str]]:
    """(errors per file, the error lines) of mypy over megatron_rl and ckpt_tools."""
    from mypy import api

    out, _, _ = api.run(["megatron_rl", "ckpt_tools"])
    lines = [ln for ln in out.splitlines() if ERROR.match(ln)]
    return Counter(ERROR.match(ln)["file"] for ln in lines), lines


def main(argv: list[str]) -> int:
    counts, lines = errors()
    if "--update" in argv:
        BASELINE.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")
        print(f"mypy baseline: {sum(counts.values())} errors in {len(counts)} files -> {BASELINE}")
        return 0
    base = json.loads(BASELINE.read_text())
    worse = {f: n for f, n in counts.items() if n > base.get(f, 0)}
    better = {f: n for f, n in base.items() if counts.get(f, 0) < n}
    for f, n in sorted(worse.items()):
        print(f"mypy: {f}: {n} errors, baseline {base.get(f, 0)}:", file=sys.stderr)
        for ln in lines:
            if ln.startswith(f + ":"):
                print("  " + ln, file=sys.stderr)
    for f, n in sorted(better.items()):
        print(f"mypy: {f}: {counts.get(f, 0)} errors, baseline {n}: lower it (python {__file__} --update)")
    if worse or better:
        return 1
    print(f"mypy baseline: {sum(counts.values())} errors in {len(counts)} files, none new")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
