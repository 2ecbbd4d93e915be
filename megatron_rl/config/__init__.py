"""Typed configuration: one dataclass per section, verl's key names, validated as a whole.

Loading order: dataclass defaults <- a YAML file <- dotted command-line overrides
(``actor_rollout_ref.actor.optim.lr=1e-6``). Unknown keys fail with a did-you-mean suggestion, wrong
types name the key, and :func:`validate` checks the combinations (batch sizes against the
data-parallel size, parallel sizes against the model's head counts) before any process group starts.

    cfg = load_config("yaml/cpu_demo.yaml", ["trainer.total_training_steps=3"])
    validate(cfg, world_size=2)

``python -m megatron_rl.config yaml/X.yaml key=value ...`` prints the fully resolved config.

The package: ``schema`` (Config and the other sections), ``model_sections`` (the model, optimizer and megatron
sections), ``rollout_sections`` (the engine, sampling and multi-turn sections), ``load`` (load_config,
derived defaults), ``checks`` (validate), ``specs`` (the facts each role reads, resolved once after
validation), ``describe`` (the key reference and the command line).
"""

from megatron_rl.config.checks import validate
from megatron_rl.config.describe import describe_keys, field_docs, main
from megatron_rl.config.errors import ConfigError, DataError
from megatron_rl.config.layout import check_layout_against_model
from megatron_rl.config.load import known_keys, load_config, to_dict
from megatron_rl.config.model_sections import (
    ActorMegatronConfig,
    CriticModelConfig,
    FrozenMegatronConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
)
from megatron_rl.config.ranges import RANGES, get_key, range_rule
from megatron_rl.config.rollout_sections import RolloutConfig, ValKwargs
from megatron_rl.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    FilterGroupsConfig,
    HttpRewardConfig,
    KLCtrlConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    RefConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
)
from megatron_rl.config.specs import Specs, keeps_engine_log_probs, needs_reference, resolve

__all__ = [
    "keeps_engine_log_probs",
    "needs_reference",
    "ActorConfig",
    "ActorMegatronConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "DataError",
    "FilterGroupsConfig",
    "FrozenMegatronConfig",
    "HttpRewardConfig",
    "KLCtrlConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RANGES",
    "RefConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TrainerConfig",
    "ValKwargs",
    "check_layout_against_model",
    "describe_keys",
    "field_docs",
    "get_key",
    "known_keys",
    "load_config",
    "main",
    "range_rule",
    "resolve",
    "Specs",
    "to_dict",
    "validate",
]
