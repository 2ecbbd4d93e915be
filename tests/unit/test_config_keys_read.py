"""Every config key is read by the code: a field that nothing reads is a knob that does nothing."""

import ast
from pathlib import Path

from megatron_rl.config import Config, to_dict
from megatron_rl.dotted import leaves

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"


def _attributes_read() -> set[str]:
    """Names read as attributes (``x.name``) anywhere in the package. Dataclass field definitions are
    annotated names, not attribute reads, so a field is found only where some code uses it."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def test_every_config_key_is_read_somewhere():
    read = _attributes_read()
    keys = [k for k, _ in leaves(to_dict(Config()))]
    unread = [k for k in keys if k.split(".")[-1] not in read]
    assert not unread, f"config keys that no code reads: {unread}"


def test_the_check_can_fail():
    # negative control: a name no code reads is reported
    assert "surely_no_module_reads_this_field" not in _attributes_read()
