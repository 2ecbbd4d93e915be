"""Every trainer command the docs show runs as written: each ``torchrun ... -m megatron_rl.train``,
``launch/torchrun.sh``, ``sbatch launch/slurm.sbatch`` and ``python -m megatron_rl.config`` line of
README.md, docs/*.md and the shipped configs' headers that names a config file is dry-run
(``python -m megatron_rl.config --check`` with the command's arguments and process count, ``--no-device``
for GPU configs). A line with ``...`` is a template, not a command.

The files a command names stand in for the reader's own: the demo's data for every dataset path, for an
HF model directory a config.json of that model's real dimensions (what the checks read) beside an empty
weights file, ``run.yaml`` (the reader's config in docs/rewards.md) the GSM8K quickstart config, and
tiny ``my_reward.py`` / ``my_agent.py`` functions. ``/models/X`` is read as ``models/X`` in the test's
directory."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil

import pytest

import yaml
from megatron_rl.run.preflight import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHERS = ("torchrun ", "launch/torchrun.sh ", "sbatch ", "python -m megatron_rl.config ")

# config.json of the models the docs name (their published dimensions)
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6)
QWEN2 |= dict(max_position_embeddings=32768, rope_theta=1000000.0, vocab_size=151936)
MODELS = {
    "Qwen2.5-0.5B-Instruct": QWEN2
    | dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)
    | dict(num_hidden_layers=24, tie_word_embeddings=True),
    "Qwen2.5-1.5B-Instruct": QWEN2
    | dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
    | dict(num_hidden_layers=28, tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": QWEN2
    | dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)
    | dict(num_hidden_layers=28, tie_word_embeddings=False),
}
# a reward model: a one-score classifier on the 0.5B body
MODELS["my-rm"] = MODELS["Qwen2.5-0.5B-Instruct"] | dict(
    architectures=["Qwen2ForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"}
)

MY_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
MY_AGENT = "def agent_fn(item, base_url):\n    return None\n"


def _sources() -> list[tuple[str, str]]:
    """(file, text) of README.md, docs/*.md and the shipped configs' header comments."""
    out = [(p, open(os.path.join(ROOT, p)).read()) for p in ["README.md", *_rel("docs/*.md")]]
    for p in _rel("yaml/*.yaml"):
        with open(os.path.join(ROOT, p)) as f:
            head = [ln[1:].strip() for ln in f if ln.startswith("#")]
        out.append((p, "```\n" + "\n".join(head) + "\n```"))
    return out


def _rel(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line that names a config file; fenced blocks join their
    backslash-continued lines, inline code spans count too; a trailing ``# comment`` is dropped."""
    found = []
    for path, text in _sources():
        lines = []
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
        lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for line in lines:
            line = re.split(r"\s#\s", line)[0].strip()
            if line.startswith(LAUNCHERS) and ".yaml" in line and "..." not in line:
                found.append((path, line))
    return found


def dry_run_args(command: str) -> list[str]:
    """The dry run of a launch command: its process count and nodes, then the trainer's arguments."""
    words = shlex.split(command)
    opts: list[str] = []
    if words[0] == "python":  # python -m megatron_rl.config ARGS
        rest = words[3:]
    elif words[0] == "torchrun":
        i = words.index("megatron_rl.train")
        for w in words[1 : i - 1]:
            if m := re.fullmatch(r"--nproc[_-]per[_-]node=(\d+)", w):
                opts += ["--nproc", m[1]]
            elif m := re.fullmatch(r"--nnodes=(\d+)", w):
                opts += ["--nnodes", m[1]]
        rest = words[i + 1 :]
    else:  # launch/torchrun.sh [options] ARGS | sbatch [sbatch options] launch/slurm.sbatch ARGS
        i = next(k for k, w in enumerate(words) if w.startswith("launch/"))
        for w in words[1:i]:
            if m := re.fullmatch(r"--(nodes|gpus-per-node)=(\d+)", w):
                opts += ["--nnodes" if m[1] == "nodes" else "--nproc", m[2]]
        rest, k = [], i + 1
        while k < len(words):
            w = words[k]
            if w in ("--nproc", "--gpus", "--nnodes"):
                opts += ["--nproc" if w != "--nnodes" else "--nnodes", words[k + 1]]
                k += 2
            elif w in ("--node-rank", "--master-addr", "--master-port", "--log-dir", "--max-restarts"):
                k += 2
            else:
                rest.append(w)
                k += 1
    rest = [re.sub(r"=/models/", "=models/", w) for w in rest]
    config = next(w for w in rest if w.endswith(".yaml"))
    key = "actor_rollout_ref.model.path"
    if not any(w.startswith(key + "=") for w in rest):  # the config's own /models/X, read as models/X
        shipped = os.path.join(ROOT, "yaml", os.path.basename(config))
        if os.path.isfile(shipped):
            with open(shipped) as f:
                path = yaml.safe_load(f)["actor_rollout_ref"]["model"].get("path", "")
            if path.startswith("/models/"):
                rest.append(f"{key}={path[1:]}")
    gpu = not os.path.basename(config).startswith("cpu_")
    return ["--check", *opts, *(["--no-device"] if gpu else []), *[w for w in rest if w != "--check"]]


@pytest.fixture(scope="module")
def reader_dir(tmp_path_factory) -> str:
    """A working directory holding the files the commands name."""
    from megatron_rl.demo import prepare
    from megatron_rl.demo.tools_task import prepare as prepare_tools

    d = str(tmp_path_factory.mktemp("reader"))
    demo = prepare(os.path.join(d, ".demo"), moe=True)
    prepare_tools(os.path.join(d, ".demo", "tools"))
    for name in ("gsm8k", "gsm8k_tools"):
        os.makedirs(os.path.join(d, "data", name))
        shutil.copy(demo["train"], os.path.join(d, "data", name, "train.parquet"))
        shutil.copy(demo["test"], os.path.join(d, "data", name, "test.parquet"))
    for name, config in MODELS.items():
        os.makedirs(os.path.join(d, "models", name))
        with open(os.path.join(d, "models", name, "config.json"), "w") as f:
            json.dump(config, f)
        open(os.path.join(d, "models", name, "model.safetensors"), "w").close()
    os.symlink(os.path.join(ROOT, "examples"), os.path.join(d, "examples"))
    with open(os.path.join(ROOT, "yaml", "gsm8k_qwen2.5_0.5b.yaml")) as f:
        run = yaml.safe_load(f)
    run["actor_rollout_ref"]["model"]["path"] = "models/Qwen2.5-0.5B-Instruct"
    with open(os.path.join(d, "run.yaml"), "w") as f:
        yaml.safe_dump(run, f)
    with open(os.path.join(d, "my_reward.py"), "w") as f:
        f.write(MY_REWARD)
    with open(os.path.join(d, "my_agent.py"), "w") as f:
        f.write(MY_AGENT)
    return d


COMMANDS = doc_commands()


def test_the_docs_show_commands():
    files = {f for f, _ in COMMANDS}
    assert {"README.md", "docs/cluster.md", "docs/multi_turn.md", "docs/placement.md"} <= files, files
    assert len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[f"{f}:{c[:60]}" for f, c in COMMANDS])
def test_a_documented_command_passes_the_dry_run(where, command, reader_dir, monkeypatch, capsys):
    monkeypatch.chdir(reader_dir)
    args = dry_run_args(command)
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 0, f"{where}: {command}\n  dry run {' '.join(args)}:\n{err}"
