"""Every config key is read by the code, section by section: a field that nothing reads is a knob that
does nothing.

For each dotted key ``section.leaf`` the test looks for an attribute read ``x.leaf`` in a module that
reaches ``section``: one that holds the section's dotted path as a string (``"critic.megatron"``, as
get_key and the memory planner use it), reads every part of the path as an attribute
(``cfg.critic`` ... ``c.megatron``), or names the dataclass of the section or of a section above it
(a helper taking an ``mcfg: MegatronConfig``, or an ``ActorConfig`` whose ``policy_loss`` it reads).
The modules are parsed, not run.

What it catches: a key whose name no module near its section reads (a training key on a forward-only
model's section, a field that moved and left its old name behind, a knob only validated). What it
cannot: a read of the right name on the wrong section inside a module that reaches both (``mcfg`` of
the actor where the critic's was meant), or a value read and then ignored. Which keys a section holds
at all is its type's business: :func:`test_forward_only_sections_hold_no_training_keys`.
"""

import ast
import dataclasses
from functools import cache
from pathlib import Path

from megatron_rl.config import Config, known_keys
from megatron_rl.config.model_sections import TRAINED_MEGATRON_SECTIONS, TRAINED_ONLY_KEYS

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
TABLE = PACKAGE / "verl_rules.py"  # verl's key patterns: strings that name sections, no reads

VALIDATED_ONLY = {
    "actor_rollout_ref.rollout.multi_turn.format": "one tool-call format exists (hermes); validate "
    "refuses any other value",
}
"""Keys that only validation reads, with the reason they are keys at all."""


@dataclasses.dataclass(frozen=True)
class Module:
    attributes: frozenset[str]
    """Names read as attributes (``x.name``); field definitions are annotations, not reads."""
    strings: frozenset[str]
    names: frozenset[str]
    """Names used or imported (``MegatronConfig``)."""


@cache
def _modules() -> dict[Path, Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if path == TABLE:
            continue
        attrs, strings, names = set(), set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attrs.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.alias):
                names.add(node.name.rsplit(".", 1)[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
        out[path] = Module(frozenset(attrs), frozenset(strings), frozenset(names))
    return out


def sections(obj=None, path: str = "", above: tuple[str, ...] = ()):
    """(dotted section, its dataclass instance, the type names of the sections above it) for every
    section of the config tree."""
    obj = Config() if obj is None else obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield f"{path}{f.name}", value, above
            yield from sections(value, f"{path}{f.name}.", (*above, type(value).__name__))


def readers(section: str, type_names: tuple[str, ...]) -> list[Path]:
    """The modules that reach ``section`` (module docstring); ``type_names``: its dataclass's and
    those of the sections above it."""
    parts = set(section.split("."))
    return [
        path
        for path, m in _modules().items()
        if any(s == section or s.startswith(section + ".") for s in m.strings)
        or parts <= m.attributes
        or any(t in m.names for t in type_names)
    ]


def is_read(section: str, type_name: str, leaf: str, above: tuple[str, ...] = ()) -> bool:
    return any(leaf in _modules()[p].attributes for p in readers(section, (type_name, *above)))


def test_every_config_key_is_read_where_its_section_is():
    unread = []
    for section, obj, above in sections():
        for f in dataclasses.fields(obj):
            key = f"{section}.{f.name}"
            if dataclasses.is_dataclass(getattr(obj, f.name)) or key in VALIDATED_ONLY:
                continue
            if not is_read(section, type(obj).__name__, f.name, above):
                unread.append(key)
    assert not unread, f"config keys that no code reaching their section reads: {unread}"


def test_forward_only_sections_hold_no_training_keys():
    known = known_keys(Config)
    for section in ("actor_rollout_ref.ref.megatron", "reward_model.megatron"):
        assert f"{section}.param_offload" in known
        held = sorted(k for k in TRAINED_ONLY_KEYS if f"{section}.{k}" in known)
        assert not held, f"{section} runs forward only but holds {held}"
    for section in TRAINED_MEGATRON_SECTIONS:
        for key in ("grad_offload", "optimizer_offload", "use_distributed_optimizer", "overlap_grad_reduce"):
            assert f"{section}.{key}" in known and is_read(section, "MegatronConfig", key), f"{section}.{key}"


def test_the_check_can_fail():
    # negative controls: a name nobody reads, and a name read elsewhere but not where its section is
    assert not is_read("critic.megatron", "MegatronConfig", "surely_no_module_reads_this_field")
    assert any("kl_cov_ratio" in m.attributes for m in _modules().values())
    assert not is_read("trainer.placement", "PlacementConfig", "kl_cov_ratio")
