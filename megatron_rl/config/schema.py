"""The config's sections: one dataclass per section, verl's key names, a docstring per field (the
reference ``python -m megatron_rl.config --keys`` prints). The model sections (weights, optimizer,
megatron layout) are in :mod:`megatron_rl.config.model_sections`, the rollout sections (engine,
sampling, multi-turn) in :mod:`megatron_rl.config.rollout_sections`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.model_sections import (
    ActorMegatronConfig,
    CriticModelConfig,
    FrozenMegatronConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
)
from megatron_rl.config.rollout_sections import RolloutConfig

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
    """Seed of the prompts' order; the responses are sampled with actor_rollout_ref.rollout.seed."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length (the count is logged) instead of truncating."""
    truncation: str = "error"
    """What to do with an overlong prompt when it is not filtered: error | left | right | middle."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """Policy loss: vanilla (PPO clip + dual-clip) | gspo | sapo | gpg | cispo | clip_cov | kl_cov | geo_mean
    | dppo_tv (formulas in megatron_rl/algos/policy_loss.py)."""
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
class RouterReplayConfig:
    mode: str = "disabled"
    """MoE actors: disabled | R2 (updates route each token to the experts of the step's old-log-prob
    pass) | R3 (every training forward routes each token as the rollout engine did); models/routing.py."""


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (over all DP ranks, before rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per forward/backward on one GPU; gradients accumulate over micro-batches."""
    use_dynamic_bsz: bool = False
    """Micro-batches by a token budget (length-sorted, each cut to its longest sequence) instead of
    ppo_micro_batch_size_per_gpu sequences; the default of the ref, rollout, critic *use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 16384
    """use_dynamic_bsz: most tokens in one update micro-batch on one GPU (real ones when packed, see
    megatron.use_remove_padding; padding included otherwise); the default of the ref and rollout
    log_prob_max_token_len_per_gpu."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per PPO step."""
    shuffle: bool = False
    """Shuffle sequences between mini-batches."""
    clip_ratio: float = 0.2
    """PPO clip range (both sides unless clip_ratio_low/high are set); for policy_loss.loss_mode=dppo_tv
    the bound on the probability change |p - p_old| (verl's DPPO example uses 0.15)."""
    clip_ratio_low: float | None = None
    """Lower clip range; defaults to clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range (clip-higher); defaults to clip_ratio."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages; for policy_loss.loss_mode=dppo_tv the cap on the
    detached importance weight (verl's DPPO example sets 10000: in effect no cap); must be > 1."""
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
    megatron: ActorMegatronConfig = field(default_factory=ActorMegatronConfig)
    """Parallel layout and memory options."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Routing replay of a mixture-of-experts actor."""


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward when computing reference log-probs."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Token-budget micro-batches for the reference log-probs; None means actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Most tokens in one reference forward; None means actor.ppo_max_token_len_per_gpu."""
    megatron: FrozenMegatronConfig = field(default_factory=FrozenMegatronConfig)
    """Parallel layout of the reference model (TP/PP must equal the actor's); forward only, so no
    gradient, optimizer or recompute keys."""


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
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Critic trunk; path defaults to the actor's."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step; defaults to the actor's."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Sequences per critic forward/backward on one GPU."""
    use_dynamic_bsz: bool | None = None
    """Token-budget micro-batches for the values and the critic update; None means
    actor_rollout_ref.actor.use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 32768
    """use_dynamic_bsz: most tokens in one critic update micro-batch on one GPU (real ones when packed,
    padding included otherwise)."""
    forward_max_token_len_per_gpu: int | None = None
    """use_dynamic_bsz: most tokens in one values forward; None means critic.ppo_max_token_len_per_gpu."""
    ppo_epochs: int | None = None
    """Critic passes per PPO step; defaults to the actor's."""
    shuffle: bool = False
    """Shuffle sequences between mini-batches."""
    cliprange_value: float = 0.5
    """Clip range of the value loss."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm: the constant the per-sequence token sums are divided by; None means
    data.max_response_length (as the actor's: every DP rank and placement scales alike)."""
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
    rollout_is_threshold: float | int | str = 2.0
    """Upper truncation of the importance weights (TIS); "lower_upper" (e.g. "0.5_2.0") zeroes the
    weights outside [lower, upper] instead (IcePop)."""
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
    """gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gpg."""
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
    max_response_bytes: int = 16 * 2**20
    """Largest reply body read (bytes); a longer reply fails the batch without being read whole."""
    proxy: str | None = None
    """HTTP(S) proxy for the reward requests (http://host:port); None = straight to the server (the
    environment's http_proxy/https_proxy are ignored)."""
    max_abandoned_threads: int = 64
    """Most threads of timed-out attempts alive at once (per rank that scores); at the bound the next
    attempt stops the run instead of starting another."""


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
    megatron: FrozenMegatronConfig = field(default_factory=FrozenMegatronConfig)
    """Parallel layout (the actor's) and weight offload of the reward model; forward only, so no
    gradient, optimizer or recompute keys."""
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
    max_error_fraction: float = 0.1
    """Most of a batch's samples the reward function may raise on (each logged, scored 0.0, counted in
    reward/num_errors); more stops the run in one line. 1.0 = only a batch that fails whole."""


@dataclass
class PlacementConfig:
    actor: list[int] | None = None
    """Global ranks that hold the actor (and the reference and reward models); None = every rank not
    listed in rollout when rollout is given, else every rank."""
    critic: list[int] | None = None
    """Global ranks that hold the critic; None = the actor's. Ranks of its own (disjoint from the actor's
    and the rollout's) compute values and the critic update while the actor trains."""
    rollout: list[int] | None = None
    """Global ranks that host the rollout engines; None = the actor's (colocated hybrid engine). Ranks
    of their own generate while the actor trains; the actor's weights reach them over the network."""
    file: str | None = None
    """YAML file with actor / critic / rollout lists; read at start, it replaces the three keys above
    (edit it, then send SIGUSR1 to re-place the running job: docs/placement.md)."""


@dataclass
class TrainerConfig:
    project_name: str = "megatron_rl"
    """Project name (logger sinks, checkpoint directory)."""
    experiment_name: str = "ppo"
    """Run name."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Sinks: console | tensorboard | wandb (jsonl is accepted: trainer.log_dir/metrics.jsonl is written
    whatever this says)."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: int | None = None
    """Stop after this many PPO steps (overrides total_epochs when set)."""
    critic_warmup: int = 0
    """Steps in which only the critic is trained."""
    test_freq: int = -1
    """Validate every this many steps (-1 = never)."""
    val_before_train: bool = True
    """Validate once before the first step (when data.val_files are given)."""
    val_only: bool = False
    """Validate the model (the resumed checkpoint's, with trainer.resume_mode) once and stop: no
    training step, no checkpoint."""
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
    nnodes: int | None = None
    """Nodes the job expects; the world comes from torchrun, and a value set here must match it."""
    n_gpus_per_node: int | None = None
    """Processes per node the job expects; a value set here must match torchrun's."""
    device: str = "auto"
    """auto (cuda when available) | cuda | cpu."""
    dist_timeout_minutes: float = 30
    """How long a collective may wait for the other ranks before the job fails (a hung rank then ends
    the job, which ``launch/torchrun.sh --max-restarts`` restarts from its checkpoint)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which global ranks hold which role (docs/placement.md)."""
    log_dir: str | None = None
    """Where JSONL/TensorBoard logs go; defaults to default_local_dir/logs."""
    console_block_freq: int = 10
    """The console prints one line per step and every metric, grouped, every this many steps (and
    at the last step); 1 prints the grouped block every step."""
    max_nonfinite_steps: int = 3
    """A non-finite loss or gradient norm skips that optimizer step (logged, counted in
    actor|critic/nonfinite_grad_steps); after this many PPO steps in a row with a skipped update the
    run stops, leaving the last checkpoint as it was. 0 never stops."""
    sync_check_freq: int = 10
    """Every this many steps, compare the rollout engine's log-probs with the actor's on a fixed set of
    prompts (greedy, a few tokens) and stop the run if they differ beyond the rollout precision's
    tolerance (docs/reliability.md, Sync integrity); 0 = never. The per-sync weight checksums run always."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
