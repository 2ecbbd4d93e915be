"""Typed configuration: one dataclass per section, verl's key names, validated as a whole.

Loading order: dataclass defaults <- a YAML file <- dotted command-line overrides
(``actor_rollout_ref.actor.optim.lr=1e-6``). Unknown keys fail with a did-you-mean suggestion, wrong
types name the key, and :func:`validate` checks the combinations (batch sizes against the
data-parallel size, parallel sizes against the model's head counts) before any process group starts.

    cfg = load_config("yaml/cpu_demo.yaml", ["trainer.total_training_steps=3"])
    validate(cfg, world_size=2)

``python -m megatron_rl.config yaml/X.yaml key=value ...`` prints the fully resolved config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


class DataError(ValueError):
    """A problem with the prompt files; the message names the file, row and column and the fix.
    Every rank reads the same files, so the launcher prints it once."""

    same_on_all_ranks = True


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files of training prompts in verl's format (prompt, data_source, reward_model, ...)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files of validation prompts; empty disables validation."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to actor_rollout_ref.model.path."""
    prompt_key: str = "prompt"
    """Column holding the chat messages of each prompt."""
    max_prompt_length: int = 512
    """Longest prompt in tokens after the chat template; longer ones are filtered or truncated."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per PPO step (over all data-parallel ranks, before rollout.n samples each)."""
    val_batch_size: int | None = None
    """Prompts per validation batch; None means the whole validation set at once."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 1
    """Seed of the prompt sampler."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length (the count is logged) instead of truncating."""
    truncation: str = "error"
    """What to do with an overlong prompt when it is not filtered: error | left | right | middle."""


@dataclass
class ModelConfig:
    path: str = ""
    """HF model directory, torch_dist checkpoint or legacy Megatron-LM checkpoint (auto-detected)."""
    tokenizer_path: str | None = None
    """Tokenizer directory if it is not beside the weights."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the tokenizer."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (megatron's recompute, shaped by the model's
    megatron.recompute_* keys) instead of keeping them: less memory, about one more forward."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_warmup_steps: int = -1
    """Linear warmup steps; -1 derives them from lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup length as a fraction of the total optimizer steps (used when lr_warmup_steps < 0)."""
    lr_decay_style: str = "constant"
    """Schedule after warmup: constant | cosine | linear."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP/PP/DP shards) to this value; 0 disables."""
    stochastic_rounding: bool = False
    """bf16 models: round the fp32 main weights into the bf16 parameters stochastically (unbiased)
    instead of to nearest, so that updates smaller than half a bf16 ulp still move the policy."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int | None = None
    """Tensor-parallel size; None: 1 for the actor, the actor's for ref and critic (they must match)."""
    pipeline_model_parallel_size: int | None = None
    """Pipeline-parallel size; None: 1 for the actor, the actor's for ref and critic (they must match)."""
    seed: int = 42
    """Seed of the model-parallel RNG streams (the actor's section sets it for the job)."""
    params_dtype: str = "bfloat16"
    """Parameter dtype of the Megatron model: float32 | bfloat16 | float16 (float32 on CPU)."""
    use_sdpa_attention: bool = True
    """Use torch's scaled_dot_product_attention as the core attention (fused, same math)."""
    param_offload: bool = False
    """Hold this model's weights in host memory while the rollout engine generates (the actor's after
    the weight sync); they return to the GPU before the next training phase."""
    grad_offload: bool = False
    """Free the gradient buckets while the rollout engine generates (zeroed before each update anyway)."""
    optimizer_offload: bool = False
    """Hold AdamW's moments and the fp32 master weights in host memory while the rollout engine generates."""
    use_distributed_optimizer: bool = True
    """Shard the fp32 master weights and Adam's moments over the data-parallel ranks (megatron's
    distributed optimizer, ZeRO-1): optimizer memory per GPU falls as 1/DP. Its checkpoints resume at
    any DP size; a run resumes only with the setting it was saved with."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket over DP as soon as the backward pass has filled it."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated parameters during the next forward pass."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 (bf16/fp16 models); off halves the gradient buffers."""
    sequence_parallel: bool = True
    """With TP > 1: split norms, dropout and residuals along the sequence over the TP ranks (less
    activation memory, reduce-scatter/all-gather instead of all-reduce). Ignored at TP = 1."""
    recompute_granularity: str = "full"
    """With model.enable_gradient_checkpointing: full (whole layers) | selective (attention core only)."""
    recompute_method: str = "uniform"
    """Full recompute: uniform (every layer, in chunks of recompute_num_layers) | block (the first
    recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: int = 1
    """Full recompute: layers per chunk (uniform) or recomputed layers per stage (block)."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """Policy loss: vanilla (PPO clip + dual-clip) | gspo | sapo | gpg | cispo | clip_cov | kl_cov | geo_mean
    (formulas in megatron_rl/algos/policy_loss.py)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: share of the response tokens whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of the tokens that may be cut."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: share of the response tokens (largest covariance) that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log ratio| penalty."""


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (over all DP ranks, before rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one GPU; gradients accumulate over micro-batches."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per PPO step."""
    shuffle: bool = False
    """Shuffle sequences between mini-batches."""
    clip_ratio: float = 0.2
    """PPO clip range (both sides unless clip_ratio_low/high are set)."""
    clip_ratio_low: float | None = None
    """Lower clip range; defaults to clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (clip-higher); defaults to clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; must be > 1."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm: the constant the per-sequence token sums are divided by (Dr. GRPO);
    None means data.max_response_length."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Which policy-gradient loss, and its constants."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for negative advantages."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    use_kl_loss: bool = False
    """Add KL(actor || ref) to the actor loss (GRPO style) instead of shaping rewards."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: kl | abs | mse | low_var_kl (k1 | k2 | k3 also accepted); a "+" suffix
    (k3+, low_var_kl+, ...) keeps the value and takes the k2 gradient (straight-through)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout and memory options."""


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward when computing reference log-probs."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the reference model (TP/PP must equal the actor's)."""


@dataclass
class ValKwargs:
    temperature: float = 0.0
    """Validation sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Validation nucleus sampling."""
    top_k: int = -1
    """Validation top-k (-1 = off)."""
    n: int = 1
    """Samples per validation prompt."""
    do_sample: bool = False
    """Sample during validation (False = greedy)."""


@dataclass
class RolloutConfig:
    name: str = "sglang"
    """Rollout engine: sglang (GPU) | hf (transformers, CPU or GPU)."""
    n: int = 1
    """Responses sampled per prompt (GRPO/RLOO need n > 1)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    do_sample: bool = True
    """Sample (False = greedy)."""
    dtype: str = "bfloat16"
    """Engine weight dtype."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the rollout engine (may differ from training TP)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory for the engine's weights and KV cache (SGLang mem_fraction_static)."""
    max_num_batched_tokens: int = 8192
    """Most tokens in one prefill batch of the engine."""
    free_cache_engine: bool = True
    """Release the engine's memory during training (colocated hybrid engine)."""
    enable_cuda_graph: bool = True
    """Capture CUDA graphs for decoding (SGLang)."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward when recomputing old log-probs."""
    update_weights_bucket_megabytes: int = 512
    """Size of the buckets in which weights are streamed into the engine."""
    calculate_log_probs: bool = False
    """Keep the engine's log-probs of the sampled tokens and log the rollout-training mismatch metrics
    (training/rollout_probs_diff_*, rollout_corr/*); on whenever algorithm.rollout_correction corrects."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling parameters of validation."""


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model to train."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy optimisation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy for the KL term."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""


@dataclass
class CriticConfig:
    enable: bool | None = None
    """Train a critic; None means: when algorithm.adv_estimator needs one (gae)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Critic trunk (same architecture and size as the actor); path defaults to the actor's."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step; defaults to the actor's."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per critic forward/backward on one GPU."""
    ppo_epochs: int | None = None
    """Critic passes per PPO step; defaults to the actor's."""
    shuffle: bool = False
    """Shuffle sequences between mini-batches."""
    cliprange_value: float = 0.5
    """Clip range of the value loss."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule of the critic."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout of the critic (TP/PP must equal the actor's)."""


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    """KL coefficient controller: fixed | adaptive."""
    kl_coef: float = 0.001
    """Initial (or fixed) KL coefficient of the reward penalty."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = None
    """Truncated importance sampling of the policy loss by pi_train / pi_rollout: token | sequence | None."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights."""
    rollout_is_batch_normalize: bool = False
    """Rescale the truncated weights to mean 1 over the batch."""
    rollout_rs: str | None = None
    """Rejection (masked IS): comma list of token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    seq_max_k2|k3; tokens/sequences out of bounds get no loss. seq_sum_k1 is sequence-level MIS."""
    rollout_rs_threshold: str | None = None
    """Bounds of rollout_rs, one or one per option: k1 "lower_upper" (or U for 1/U..U), k2/k3 an upper."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """Drop groups whose samples all have the same metric, and generate more prompts to refill the batch."""
    metric: str | None = None
    """acc | score | seq_reward | seq_final_reward, or a key the reward function returns; None = acc."""
    max_num_gen_batches: int = 0
    """Most generation rounds per step before the run stops with an error (0 = no limit)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's standard deviation."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty: kl | abs | mse | low_var_kl."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL coefficient controller."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=lambda: RolloutCorrectionConfig())
    """Correction of the rollout-training mismatch (importance weights, rejection)."""
    filter_groups: FilterGroupsConfig = field(default_factory=lambda: FilterGroupsConfig())
    """DAPO's dynamic sampling: drop prompt groups whose samples all score the same."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's overlong shaping: penalise responses that run into the last ``len`` tokens of
    data.max_response_length, linearly down to -penalty_factor at the limit."""
    len: int = 0
    """Buffer length in tokens."""
    penalty_factor: float = 0.0
    """Penalty at data.max_response_length."""
    log: bool = False
    """Log reward/overlong_reward/mean and reward/overlong/mean."""


@dataclass
class RewardModelModelConfig:
    path: str = ""
    """HF sequence-classification directory (a score head with one output) or a Megatron checkpoint of one."""
    input_tokenizer: str | None = None
    """The actor's tokenizer, which the responses are decoded with (default: data.tokenizer) before the
    reward model's own tokenizer and chat template re-encode the conversation."""
    trust_remote_code: bool = False
    """Allow custom code in the reward model's tokenizer files."""


@dataclass
class HttpRewardConfig:
    url: str | None = None
    """POST batches of {data_source, prompt, response, ground_truth, extra_info} here and read scores back;
    None = off."""
    batch_size: int = 64
    """Samples per request."""
    concurrency: int = 4
    """Requests in flight at once (per rank that scores)."""
    timeout_s: float = 30.0
    """Longest wait for one request's reply."""
    retries: int = 3
    """Further attempts after a failed request (connection error, timeout, HTTP 5xx/429)."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled for each further one."""


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score responses with a learned reward model (reward_model.model.path) instead of the rules."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model's weights and tokenizer."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per reward-model forward."""
    max_length: int | None = None
    """Longest re-tokenized conversation the reward model reads (default: prompt + response lengths)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout (the actor's) and memory options of the reward model."""
    http: HttpRewardConfig = field(default_factory=HttpRewardConfig)
    """Rewards served over HTTP (instead of the rules or a reward model)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping (DAPO)."""


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None
    """Python file holding a reward function; None uses the built-in rules by data_source."""
    name: str = "compute_score"
    """Function name in that file: f(data_source, solution_str, ground_truth, extra_info) -> float."""
    timeout_s: float = 60.0
    """Longest a single reward call may take; a call that hangs (or exits the process) stops the run with
    one line naming the function, the sample and its data_source. 0 = no limit. The file is Python
    code run on every rank: use only reward files you trust."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the reward function (built-in GSM8K rule: method, format_score, score,
    lenient)."""


@dataclass
class TrainerConfig:
    project_name: str = "megatron_rl"
    """Project name (logger sinks, checkpoint directory)."""
    experiment_name: str = "ppo"
    """Run name."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Sinks: console | jsonl | tensorboard | wandb."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: int | None = None
    """Stop after this many PPO steps (overrides total_epochs when set)."""
    critic_warmup: int = 0
    """Steps in which only the critic is trained."""
    test_freq: int = -1
    """Validate every this many steps (-1 = never)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    save_freq: int = -1
    """Save a checkpoint every this many steps (-1 = only at the end if save_at_end)."""
    save_at_end: bool = True
    """Save after the last step."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoint directory."""
    resume_mode: str = "auto"
    """auto (latest in default_local_dir) | disable | resume_path (trainer.resume_from_path)."""
    resume_from_path: str | None = None
    """Checkpoint to resume from when resume_mode=resume_path."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest this many checkpoints, newest by save order across runs (None keeps all);
    the checkpoint just written and the one the run resumed from are never deleted."""
    checkpoint_permissions: str = "0600"
    """Octal mode of every checkpoint file (weights, optimizer states, trainer_state.json, the tracker),
    as a quoted string; directories get the matching search bits ("0600" -> 0700, "0640" -> 0750)."""
    nnodes: int = 1
    """Nodes of the job (informational; the world comes from torchrun)."""
    n_gpus_per_node: int = 8
    """Processes per node (informational; the world comes from torchrun)."""
    device: str = "auto"
    """auto (cuda when available) | cuda | cpu."""
    dist_timeout_minutes: int = 30
    """How long a collective may wait for the other ranks before the job fails."""
    log_dir: str | None = None
    """Where JSONL/TensorBoard logs go; defaults to default_local_dir/logs."""
    console_block_freq: int = 10
    """The console prints one line per step and every metric, grouped, every this many steps (and
    at the last step); 1 prints the grouped block every step."""
    max_nonfinite_steps: int = 3
    """A non-finite loss or gradient norm skips that optimizer step (logged, counted in
    actor|critic/nonfinite_grad_steps); after this many PPO steps in a row with a skipped update the
    run stops, leaving the last checkpoint as it was. 0 never stops."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _known_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> dataclass field type, for every leaf and section."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out[key] = f.type
        ftype = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        sub = ftype() if ftype is not None else None
        if dataclasses.is_dataclass(sub):
            out.update(_known_keys(type(sub), key + "."))
    return out


def leaves(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict; an empty dict is a leaf."""
    if not isinstance(d, dict) or not d:
        return [(prefix[:-1], d)] if prefix else []
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += leaves(v, f"{prefix}{k}.")
    return out


def _check_keys(raw: dict, source: str) -> None:
    known = _known_keys(Config)
    # Keys under a dict-typed field (custom_reward_function.reward_kwargs.*) are the user's own.
    free = tuple(k + "." for k, t in known.items() if str(t).startswith("dict"))
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    for key, value in leaves(raw):
        if key in sections and value is not None:
            example = next(k for k in known if k.startswith(key + "."))
            raise ConfigError(
                f"'{key}' (from {source}) is a section of keys, not a value: got {value!r}; write its keys "
                f"under it (e.g. {example}=...)."
            )
        if key not in known and not key.startswith(free):
            near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"Unknown config key '{key}' (from {source}).{hint}")


def _lists_from_scalars(raw: dict, prefix: str = "") -> dict:
    """A scalar given for a list-typed key becomes a one-element list (``data.train_files=x.parquet``,
    ``trainer.logger=console``), as verl's command lines write them."""
    known = _known_keys(Config)
    out = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _lists_from_scalars(v, key + ".")
        elif str(known.get(key, "")).startswith("list") and v is not None and not isinstance(v, list):
            out[k] = [v]
        else:
            out[k] = v
    return out


def _strip_hydra_prefix(override: str) -> str:
    """``+key=value`` / ``++key=value`` (Hydra: add / force-add a key) set a key like ``key=value``;
    the key itself must still be one this config knows."""
    return override.lstrip("+")


def load_config(
    yaml_path: str | None = None, overrides: list[str] | None = None, notices: list[str] | None = None
) -> Config:
    """Defaults <- YAML file <- dotted overrides; returns a typed, resolved :class:`Config`.

    verl's keys that this config does not hold are handled by :mod:`megatron_rl.verl_compat`
    (aliased, refused in one line, or ignored with a line appended to ``notices``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.verl_compat import translate

    known = set(_known_keys(Config))
    notices = [] if notices is None else notices

    merged = OmegaConf.structured(Config)
    layers = []
    if yaml_path:
        if not os.path.exists(yaml_path):
            raise ConfigError(f"Config file not found: {yaml_path}")
        loaded = OmegaConf.load(yaml_path)
        if not isinstance(OmegaConf.to_container(loaded, resolve=False), dict):
            raise ConfigError(f"{yaml_path}: the top level of a config file must be a mapping of sections.")
        layers.append((loaded, yaml_path))
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"Overrides must look like key=value; got {bad}")
        overrides = [_strip_hydra_prefix(o) for o in overrides]
        layers.append((OmegaConf.from_dotlist(list(overrides)), "command line"))
    for layer, source in layers:
        try:
            raw = translate(OmegaConf.to_container(layer, resolve=False), known, source, notices)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_keys(raw, source)
        layer = OmegaConf.create(_lists_from_scalars(raw))
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            why = (e.msg or str(e) or type(e).__name__).splitlines()[0]
            raise ConfigError(f"Bad value for '{key}' (from {source}): {why}") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"Config could not be resolved at '{getattr(e, 'full_key', '?')}': {e.msg}"
        ) from None
    _fill_derived(cfg)
    return cfg


def _fill_derived(cfg: Config) -> None:
    """Defaults that are defined in terms of other keys (one source of truth for each value)."""
    arr = cfg.actor_rollout_ref
    am = arr.actor.megatron
    # None means "the default"; 0 stays 0 and fails validation (it is no layout)
    if am.tensor_model_parallel_size is None:
        am.tensor_model_parallel_size = 1
    if am.pipeline_model_parallel_size is None:
        am.pipeline_model_parallel_size = 1
    for m in (arr.ref.megatron, cfg.critic.megatron, cfg.reward_model.megatron):
        if m.tensor_model_parallel_size is None:
            m.tensor_model_parallel_size = am.tensor_model_parallel_size
        if m.pipeline_model_parallel_size is None:
            m.pipeline_model_parallel_size = am.pipeline_model_parallel_size
    if not cfg.critic.model.path:
        cfg.critic.model.path = arr.model.path
    if cfg.critic.ppo_mini_batch_size is None:
        cfg.critic.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
    if cfg.critic.ppo_epochs is None:
        cfg.critic.ppo_epochs = arr.actor.ppo_epochs
    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator == "gae"
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = arr.model.tokenizer_path or arr.model.path
    if arr.actor.loss_scale_factor is None:
        arr.actor.loss_scale_factor = cfg.data.max_response_length
    if arr.actor.clip_ratio_low is None:
        arr.actor.clip_ratio_low = arr.actor.clip_ratio
    if arr.actor.clip_ratio_high is None:
        arr.actor.clip_ratio_high = arr.actor.clip_ratio
    if cfg.trainer.log_dir is None:
        cfg.trainer.log_dir = os.path.join(cfg.trainer.default_local_dir, "logs")


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _choices() -> dict[str, tuple]:
    """Keys with a fixed set of values; the algorithm lists come from their registries in algos/."""
    from megatron_rl.algos import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

    return {
        **_CHOICES,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
        "critic.loss_agg_mode": LOSS_AGG_MODES,
        "actor_rollout_ref.actor.kl_loss_type": KL_PENALTIES,
        "algorithm.kl_penalty": KL_PENALTIES,
        "algorithm.adv_estimator": tuple(ADV_ESTIMATORS),
        "actor_rollout_ref.actor.policy_loss.loss_mode": tuple(POLICY_LOSSES),
        "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    }


_CHOICES = {
    "data.truncation": ("error", "left", "right", "middle"),
    "actor_rollout_ref.rollout.name": ("sglang", "hf"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor_rollout_ref.actor.optim.lr_decay_style": ("constant", "cosine", "linear"),
    "critic.optim.lr_decay_style": ("constant", "cosine", "linear"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.device": ("auto", "cuda", "cpu"),
    "actor_rollout_ref.actor.megatron.params_dtype": ("float32", "bfloat16", "float16"),
    "actor_rollout_ref.actor.megatron.recompute_granularity": ("full", "selective"),
    "actor_rollout_ref.actor.megatron.recompute_method": ("uniform", "block"),
    "critic.megatron.recompute_granularity": ("full", "selective"),
    "critic.megatron.recompute_method": ("uniform", "block"),
    "actor_rollout_ref.rollout.dtype": ("float32", "bfloat16", "float16"),
}


# Every numeric key's range (fnmatch patterns over the dotted key; None values pass: "unset").
# ">0" / ">=1" / "[0,1]" / "(0,1]" / "any"; tests/unit/test_config.py checks that every numeric key has one.
RANGES: dict[str, str] = {
    "data.max_prompt_length": ">=1",
    "data.max_response_length": ">=1",
    "data.train_batch_size": ">=1",
    "data.val_batch_size": ">=1",
    "data.seed": "any",
    "*.ppo_mini_batch_size": ">=1",
    "*.ppo_micro_batch_size_per_gpu": ">=1",
    "*.log_prob_micro_batch_size_per_gpu": ">=1",
    "*.ppo_epochs": ">=1",
    "actor_rollout_ref.actor.clip_ratio": ">0",
    "actor_rollout_ref.actor.clip_ratio_low": ">=0",
    "actor_rollout_ref.actor.clip_ratio_high": ">=0",
    "actor_rollout_ref.actor.clip_ratio_c": ">1",
    "actor_rollout_ref.actor.loss_scale_factor": ">0",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": "[0,1]",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": "any",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub": "any",
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": "[0,1]",
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": ">=0",
    "actor_rollout_ref.actor.tau_*": ">0",
    "actor_rollout_ref.actor.entropy_coeff": "any",
    "actor_rollout_ref.actor.kl_loss_coef": ">=0",
    "*.optim.lr": ">=0",
    "*.optim.min_lr": ">=0",
    "*.optim.lr_warmup_steps": ">=-1",
    "*.optim.lr_warmup_steps_ratio": "[0,1]",
    "*.optim.weight_decay": ">=0",
    "*.optim.eps": ">0",
    "*.optim.clip_grad": ">=0",
    "*.megatron.tensor_model_parallel_size": ">=1",
    "*.megatron.pipeline_model_parallel_size": ">=1",
    "*.megatron.seed": "any",
    "*.megatron.recompute_num_layers": ">=1",
    "actor_rollout_ref.rollout.n": ">=1",
    "actor_rollout_ref.rollout.temperature": ">0",
    "actor_rollout_ref.rollout.top_p": "(0,1]",
    "actor_rollout_ref.rollout.top_k": ">=-1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ">=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "(0,1]",
    "actor_rollout_ref.rollout.max_num_batched_tokens": ">=1",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": ">=1",
    "actor_rollout_ref.rollout.val_kwargs.temperature": ">=0",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "(0,1]",
    "actor_rollout_ref.rollout.val_kwargs.top_k": ">=-1",
    "actor_rollout_ref.rollout.val_kwargs.n": ">=1",
    "critic.cliprange_value": ">0",
    "algorithm.gamma": "[0,1]",
    "algorithm.lam": "[0,1]",
    "algorithm.kl_ctrl.kl_coef": ">=0",
    "algorithm.kl_ctrl.horizon": ">=1",
    "algorithm.kl_ctrl.target_kl": ">0",
    "algorithm.rollout_correction.rollout_is_threshold": ">0",
    "algorithm.filter_groups.max_num_gen_batches": ">=0",
    "reward_model.overlong_buffer.len": ">=0",
    "reward_model.overlong_buffer.penalty_factor": ">=0",
    "custom_reward_function.timeout_s": ">=0",
    "reward_model.micro_batch_size_per_gpu": ">=1",
    "reward_model.max_length": ">=1",
    "reward_model.http.batch_size": ">=1",
    "reward_model.http.concurrency": ">=1",
    "reward_model.http.timeout_s": ">0",
    "reward_model.http.retries": ">=0",
    "reward_model.http.backoff_s": ">=0",
    "trainer.total_epochs": ">=1",
    "trainer.total_training_steps": ">=1",
    "trainer.critic_warmup": ">=0",
    "trainer.test_freq": "any",
    "trainer.save_freq": "any",
    "trainer.max_ckpt_to_keep": ">=1",
    "trainer.nnodes": ">=1",
    "trainer.n_gpus_per_node": ">=1",
    "trainer.dist_timeout_minutes": ">=1",
    "trainer.console_block_freq": ">=1",
    "trainer.max_nonfinite_steps": ">=0",
}


def range_rule(key: str) -> str | None:
    """The RANGES rule of ``key`` (the first pattern that matches), or None."""
    import fnmatch

    return next((rule for pat, rule in RANGES.items() if fnmatch.fnmatchcase(key, pat)), None)


def _in_range(value: float, rule: str) -> bool:
    if rule == "any":
        return True
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        above = value >= lo if rule[0] == "[" else value > lo
        below = value <= hi if rule[-1] == "]" else value < hi
        return above and below
    if rule.startswith(">="):
        return value >= float(rule[2:])
    return value > float(rule[1:])  # ">x"


def _check_ranges(cfg: Config) -> None:
    """One line for the first numeric key outside its range."""
    for key, ftype in _known_keys(Config).items():
        if not (("int" in str(ftype) or "float" in str(ftype)) and "list" not in str(ftype)):
            continue
        value, rule = get_key(cfg, key), range_rule(key)
        if value is None or rule is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)) or not _in_range(value, rule):
            raise ConfigError(f"{key}={value!r} is out of range: it must be {_describe(rule)}.")


def _describe(rule: str) -> str:
    if rule[0] in "[(":
        return f"in {rule}"
    return f">= {rule[2:]}" if rule.startswith(">=") else f"> {rule[1:]}"


def get_key(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config, world_size: int, model_dims: dict[str, int] | None = None) -> None:
    """Check the config as a whole for a job of ``world_size`` processes.

    ``model_dims`` (num_attention_heads, num_key_value_heads, num_layers, vocab_size) comes from the
    model's own config; when None it is read from actor_rollout_ref.model.path if that exists.
    Raises :class:`ConfigError` naming the key and the fix.
    """
    _check_ranges(cfg)
    for key, choices in _choices().items():
        value = get_key(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {list(choices)}.")
    for sink in cfg.trainer.logger:
        if sink not in ("console", "jsonl", "tensorboard", "wandb"):
            raise ConfigError(
                f"trainer.logger: unknown sink {sink!r}; use console, jsonl, tensorboard, wandb."
            )

    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    if not arr.model.path:
        raise ConfigError("actor_rollout_ref.model.path is empty: point it at an HF model directory.")

    mp = actor.megatron
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    others = (
        ("actor_rollout_ref.ref", arr.ref.megatron),
        ("critic", cfg.critic.megatron),
        ("reward_model", cfg.reward_model.megatron),
    )
    for name, m in others:
        if (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) != (tp, pp):
            raise ConfigError(
                f"{name}.megatron.tensor/pipeline_model_parallel_size = "
                f"{m.tensor_model_parallel_size}/{m.pipeline_model_parallel_size} differ from the actor's "
                f"{tp}/{pp}; all models share one parallel layout: set them equal."
            )
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"World size {world_size} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp} x {pp}: change actor_rollout_ref.actor.megatron.* "
            f"or the number of processes."
        )
    dp = world_size // (tp * pp)
    rtp = rollout.tensor_model_parallel_size
    if rtp < 1 or world_size % rtp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} does not divide the world size "
            f"{world_size}."
        )

    def divisible(key: str, value: int, by: int, why: str) -> None:
        if value <= 0 or value % by:
            raise ConfigError(f"{key}={value} must be a positive multiple of {by} ({why}).")

    divisible("data.train_batch_size", cfg.data.train_batch_size, dp, f"data-parallel size {dp}")
    divisible(
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        actor.ppo_mini_batch_size,
        dp,
        f"data-parallel size {dp}",
    )
    if cfg.data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}."
        )
    seqs_per_rank = actor.ppo_mini_batch_size * rollout.n // dp
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro <= 0 or seqs_per_rank % micro:
        fits = [d for d in range(1, seqs_per_rank + 1) if seqs_per_rank % d == 0]
        raise ConfigError(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must be positive and divide "
            f"the {seqs_per_rank} sequences per rank of a mini-batch (ppo_mini_batch_size x rollout.n / "
            f"data-parallel size); choose one of {fits}."
        )
    if cfg.critic.enable:
        crit_mb = cfg.critic.ppo_mini_batch_size
        divisible("critic.ppo_mini_batch_size", crit_mb, dp, f"data-parallel size {dp}")
        if cfg.data.train_batch_size % crit_mb:
            raise ConfigError(
                f"data.train_batch_size={cfg.data.train_batch_size} is not a multiple of "
                f"critic.ppo_mini_batch_size={crit_mb}."
            )
        crit_seqs = crit_mb * rollout.n // dp
        crit_micro = cfg.critic.ppo_micro_batch_size_per_gpu
        if crit_micro <= 0 or crit_seqs % crit_micro:
            raise ConfigError(
                f"critic.ppo_micro_batch_size_per_gpu={crit_micro} must be positive and divide "
                f"critic.ppo_mini_batch_size x rollout.n / data-parallel size = {crit_seqs}."
            )
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of one prompt: "
            "set actor_rollout_ref.rollout.n >= 2."
        )
    if rollout.temperature <= 0:
        raise ConfigError(
            f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0 (log-probs are taken "
            "at the sampling temperature); for greedy rollouts set actor_rollout_ref.rollout.do_sample=False."
        )
    if actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1.0.")
    _validate_algorithm_options(cfg)
    if not 0.0 < rollout.gpu_memory_utilization <= 1.0:
        raise ConfigError("actor_rollout_ref.rollout.gpu_memory_utilization must be in (0, 1].")
    for section, m in (
        ("actor_rollout_ref.ref", arr.ref.megatron),
        ("reward_model", cfg.reward_model.megatron),
    ):
        for key in ("grad_offload", "optimizer_offload"):
            if getattr(m, key):
                raise ConfigError(
                    f"{section}.megatron.{key}=True: that model is not trained; only "
                    f"{section}.megatron.param_offload applies to it."
                )
    for key in ("actor_rollout_ref.actor.megatron", "critic.megatron"):
        if get_key(cfg, key).recompute_num_layers < 1:
            raise ConfigError(f"{key}.recompute_num_layers must be >= 1.")
    if rollout.update_weights_bucket_megabytes <= 0:
        raise ConfigError("actor_rollout_ref.rollout.update_weights_bucket_megabytes must be > 0.")
    for key in ("data.max_prompt_length", "data.max_response_length"):
        if get_key(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0.")
    perms = cfg.trainer.checkpoint_permissions
    if not (isinstance(perms, str) and len(perms) == 4 and perms[0] == "0" and set(perms) <= set("01234567")):
        raise ConfigError(
            f"trainer.checkpoint_permissions={perms!r} must be an octal mode as a quoted string, e.g. "
            '"0600" (owner only) or "0640" (group may read).'
        )
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError(
            "reward_model.enable=True needs reward_model.model.path: an HF ...ForSequenceClassification "
            "directory (one score output) or a Megatron checkpoint of one."
        )
    if cfg.reward_model.http.url and (cfg.reward_model.enable or cfg.custom_reward_function.path):
        raise ConfigError(
            "reward_model.http.url is set together with "
            f"{'reward_model.enable=True' if cfg.reward_model.enable else 'custom_reward_function.path'}: "
            "rewards come from one source; unset one of them."
        )

    if model_dims is None:
        model_dims = _read_model_dims(arr.model.path)
    if model_dims:
        check_layout_against_model(model_dims, tp, pp, rtp)


def _validate_algorithm_options(cfg: Config) -> None:
    """Loss scaling, mismatch correction, dynamic sampling and overlong shaping."""
    from megatron_rl.algos.rollout_corr import parse_rs

    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.loss_scale_factor={actor.loss_scale_factor} must be > 0 "
            "(or null for data.max_response_length)."
        )
    corr = alg.rollout_correction
    if corr.rollout_is is not None and corr.rollout_is_threshold <= 0:
        raise ConfigError("algorithm.rollout_correction.rollout_is_threshold must be > 0.")
    if corr.rollout_rs:
        try:
            parse_rs(corr.rollout_rs, corr.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    fg = alg.filter_groups
    if fg.enable:
        if fg.max_num_gen_batches < 0:
            raise ConfigError("algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit).")
        if fg.metric == "seq_final_reward" and alg.use_kl_in_reward:
            raise ConfigError(
                "algorithm.filter_groups.metric=seq_final_reward needs the KL-shaped rewards, which come "
                "after filtering here: use seq_reward (or acc), or algorithm.use_kl_in_reward=False."
            )
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (0 < ob.len <= cfg.data.max_response_length and ob.penalty_factor >= 0):
        raise ConfigError(
            f"reward_model.overlong_buffer: len={ob.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}] and penalty_factor={ob.penalty_factor} >= 0."
        )


def _read_model_dims(path: str) -> dict[str, int] | None:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file) as f:
        hf = json.load(f)
    heads = hf.get("num_attention_heads")
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "num_layers": hf.get("num_hidden_layers"),
    }


TP_KEY = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
PP_KEY = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"


def check_layout_against_model(
    dims: dict[str, int],
    tp: int,
    pp: int,
    rollout_tp: int | None = None,
    tp_key: str = TP_KEY,
    pp_key: str = PP_KEY,
) -> None:
    """TP (and the rollout's TP) must divide the attention and key/value heads, PP the layers. The
    trainer's config check; ``ckpt_tools`` runs it too, naming its own ``--tp``/``--pp``."""
    heads, kv, layers = dims["num_attention_heads"], dims["num_key_value_heads"], dims["num_layers"]
    sizes = [(tp_key, tp)] + (
        [] if rollout_tp is None else [("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp)]
    )
    for key, size in sizes:
        if heads % size or kv % size:
            raise ConfigError(
                f"{key}={size} must divide the model's attention heads ({heads}) and key/value heads ({kv}); "
                f"choose one of {[d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]}."
            )
    if layers % pp:
        raise ConfigError(f"{pp_key}={pp} must divide the model's {layers} layers.")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (read from this module's source)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_keys(prefix: str = "") -> str:
    """Every key under ``prefix`` with its type, default and docstring, section by section."""
    lines: list[str] = []

    def walk(obj: Any, path: str) -> None:
        docs = field_docs(type(obj))
        leaves, sections = [], []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            (sections if dataclasses.is_dataclass(value) else leaves).append((f, value))
        shown = [(f, v) for f, v in leaves if f"{path}{f.name}".startswith(prefix)]
        if shown:
            lines.append(f"[{path[:-1] or 'config'}]")
            for f, v in shown:
                lines.append(f"  {path}{f.name}: {f.type} = {v!r}")
                if docs.get(f.name):
                    lines.append(f"      {docs[f.name]}")
        for f, v in sections:
            walk(v, f"{path}{f.name}.")

    walk(Config(), "")
    return "\n".join(lines)


USAGE = """usage: python -m megatron_rl.config [[--config] FILE.yaml] [key=value ...]
       python -m megatron_rl.config --keys [PREFIX]

Prints the fully resolved config of a run (defaults <- FILE.yaml <- key=value overrides, as
megatron_rl.train resolves it), or with --keys every key (optionally only those starting with
PREFIX) with its type, default and meaning. Keys follow verl's names; `+key=value` works as
`key=value`; a scalar given for a list key becomes a one-element list."""


def main(argv: list[str] | None = None) -> None:
    """Print the fully resolved config:
    ``python -m megatron_rl.config [[--config] file.yaml] [key=value ...]`` (as ``megatron_rl.train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv and argv[0] == "--keys":
        print(describe_keys(argv[1] if len(argv) > 1 else ""))
        return
    if argv and argv[0] == "--config":
        argv.pop(0)
        if not argv:
            sys.exit("config error: --config needs a YAML file")
    yaml_path = argv.pop(0) if argv and "=" not in argv[0] else None
    from omegaconf import OmegaConf

    try:
        cfg = load_config(yaml_path, argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    print(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))), end="")


if __name__ == "__main__":
    main()
