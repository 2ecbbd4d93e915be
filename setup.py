"""megatron-rl: PPO post-training for LLMs on megatron-core."""

import re

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', open("megatron_rl/__init__.py").read()).group(1)

setup(
    name="megatron-rl",
    version=version,
    description="Megatron-native PPO trainer for LLMs with an in-process SGLang rollout engine",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # yaml/ ships as megatron_rl/configs/*.yaml: `python -m megatron_rl.config cpu_demo.yaml` (and
    # --config yaml/cpu_demo.yaml) finds a config there when no such file is in the working directory.
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "ckpt_tools", "ckpt_tools.*"])
    + ["megatron_rl.configs"],
    package_dir={"megatron_rl.configs": "yaml"},
    package_data={"megatron_rl": ["verl_keys.txt", "verl_defaults.json"], "megatron_rl.configs": ["*.yaml"]},
    install_requires=[
        # Not pinned: clusters bring their own CUDA build of torch. `make install` pins the CPU versions
        # this project is tested with; docs/gpu.md lists the tested GPU set.
        "torch>=2.6",
        "megatron-core==0.16.1",  # megatron_rl.cpu_bridge is written against this release
        "transformers>=5.12",
        "omegaconf>=2.3",
        "safetensors",
        "psutil",  # megatron's dist_checkpointing hangs on save without it
        "pyarrow",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # The GPU machine has its own torch build; install SGLang there with --no-deps from the kit.
        "sglang": ["sglang==0.5.17"],
        "dev": ["pytest", "ruff", "mypy", "matplotlib", "peft"],  # peft: the LoRA tests' oracle
        "plot": ["matplotlib"],  # python -m megatron_rl.run.plot
    },
    entry_points={
        "console_scripts": [
            "megatron-rl-train=megatron_rl.train:main",
            "megatron-rl-config=megatron_rl.run.preflight:main",
            "megatron-rl-ckpt=ckpt_tools.__main__:main",
        ]
    },
)
