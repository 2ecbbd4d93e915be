"""The rollout sections of the config, ``actor_rollout_ref.rollout`` and below: the engine and its
sampling (:class:`RolloutConfig`), validation's sampling (:class:`ValKwargs`) and multi-turn rollouts
(:class:`MultiTurnConfig`: tools, a simulated user, an agent function and the OpenAI-compatible endpoint
it talks to). Loaded with the other sections into
:class:`megatron_rl.config.schema.ActorRolloutRefConfig`; read by the engines (:mod:`megatron_rl.rollout`),
the rollout role (:mod:`megatron_rl.roles.rollout`) and the agent loop (:mod:`megatron_rl.rollout.agent`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
class AgentFunctionConfig:
    path: str | None = None
    """A .py file defining fn(item, base_url) -> reward | None: a harness that runs one episode through
    the OpenAI chat API at base_url; None = the built-in agent loop (docs/multi_turn.md)."""
    name: str = "agent_fn"
    """The function's name in that file."""


@dataclass
class OpenAIServerConfig:
    host: str = "127.0.0.1"
    """Address to bind; loopback only (the endpoint has no authentication)."""
    port: int = 0
    """Port to bind; 0 = a free port chosen by the OS (one server per rank)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted; a larger one is refused with HTTP 413 before it is read."""
    request_timeout_s: float = 300.0
    """Seconds a chat request may wait for its turn's tokens; then HTTP 504."""
    max_sessions: int = 64
    """Most sessions (episodes) open at once; also the number of harness threads."""
    episode_timeout_s: float = 1800.0
    """Seconds one agent function call may take; a slower episode fails the rollout."""
    model_name: str = "megatron-rl-policy"
    """The model id GET /v1/models lists and replies carry (a request's model is not checked)."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts: generate -> tool calls / a simulated user -> generate again (multi_turn.md)."""
    max_assistant_turns: int | None = None
    """Most model turns per episode; None = until the response budget (data.max_response_length) is spent."""
    max_user_turns: int | None = None
    """Most tool/user turns per episode; None = no limit but the response budget."""
    max_parallel_calls: int = 1
    """Tool calls of one model turn that are executed (the first ones); the rest are dropped and counted."""
    max_tool_response_length: int = 256
    """Characters of a tool's reply kept; longer replies are cut (tool_response_truncate_side)."""
    tool_response_truncate_side: str = "middle"
    """Where a long tool reply is cut: left (keep the start) | right (keep the end) | middle (keep both)."""
    tool_config_path: str | None = None
    """verl's tool config YAML (tools: - class_name, config, tool_schema); None = no tools."""
    interaction_config_path: str | None = None
    """verl's interaction config YAML (interaction: - name, class_name, config); None = no simulated user."""
    format: str = "hermes"
    """Tool-call format of the model's turns: hermes (<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>, Qwen's templates) | llama3_json (the turn is {"name": ..., "parameters": {...}}, Llama
    3.1-3.3's templates); rollout/agent/tool_formats.py."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take; a slower call becomes an error message to the model."""
    max_tokens_per_turn: int | None = None
    """Most tokens of one model turn (its max_new_tokens); None: the response budget left. A turn that
    reaches it ends there as if the model had stopped (its calls are parsed, tools and the user go on);
    the episode still ends at data.max_response_length."""
    schedule: str = "async"
    """async: an episode's next turn goes to the engine once its own turn and tools are done | lockstep:
    every turn waits for all running episodes (batch-synchronous, for comparison); docs/multi_turn.md."""
    tool_workers: int = 128
    """Threads running tool and interaction calls concurrently; calls beyond it wait for a thread (tools
    mostly wait on I/O: threads are cheap)."""
    max_abandoned_tool_calls: int = 64
    """Timed-out tool calls whose threads may still run (a thread cannot be killed; each gets a fresh
    worker in its place); beyond it new calls are refused (multi_turn/abandoned_tool_calls)."""
    tool_reward_weight: float = 0.0
    """Each episode's tool rewards (execute's step rewards + calc_reward, or the agent function's
    reward) times this are added to its score."""
    agent_function: AgentFunctionConfig = field(default_factory=AgentFunctionConfig)
    """A harness that runs the episodes through an OpenAI chat endpoint instead of the built-in loop."""
    endpoint: OpenAIServerConfig = field(default_factory=OpenAIServerConfig)
    """Bounds of the OpenAI-compatible endpoint the agent function talks to."""


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
    seed: int = 0
    """Seed of the rollout's sampling (verl's engine seed; any integer). Each response is sampled from
    its own seed, a hash of (seed, step, data-parallel rank, row, validation or not), so a run
    regenerates the same responses given the same seed and prompts. data.seed (the prompt order) and
    actor.megatron.seed (megatron's RNG streams) seed other things."""
    dtype: str | None = None
    """Engine weight dtype: float32 | bfloat16 | float16; None = the actor's megatron.params_dtype
    (an fp16 policy samples from fp16 weights: the smallest training-inference mismatch)."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the rollout engine's attention (may differ from training TP)."""
    data_parallel_size: int = 1
    """Attention data-parallel groups inside one SGLang engine (SGLang's DP attention): the engine spans
    tensor_model_parallel_size x data_parallel_size ranks (:attr:`engine_ranks`, verl's rule), its
    attention runs in data_parallel_size groups of tensor_model_parallel_size ranks, its experts, dense
    MLPs and LM head over all of them. The transformers engine holds a whole model on the first rank
    of each such group (as with the rollout's TP)."""
    expert_parallel_size: int = 1
    """Ranks of one SGLang engine its routed experts are split over (SGLang's ep_size): each holds
    num_experts / expert_parallel_size of them, cut over engine_ranks / expert_parallel_size ranks by
    expert tensor parallelism (verl asks for tensor x data parallel size; any divisor is accepted).
    MoE models only; the transformers engine holds whole models."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory for the engine's weights and KV cache (SGLang mem_fraction_static)."""
    max_num_batched_tokens: int = 8192
    """Most tokens in one prefill batch of the engine."""
    free_cache_engine: bool = True
    """Release the engine's memory during training (colocated hybrid engine)."""
    engine_restarts: int = 1
    """Colocated: times one step's rollout may restart a failed engine in place (every rank's engine
    shut down and started again, the weights synced again, the step generated again) before the job
    fails (then launch/torchrun.sh --max-restarts restarts it from its checkpoint); 0: fail at once."""
    enable_cuda_graph: bool = True
    """Capture CUDA graphs for decoding (SGLang)."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Sequences per forward when recomputing old log-probs."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Token-budget micro-batches for the old log-probs; None means actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Most tokens in one old-log-prob forward; None means actor.ppo_max_token_len_per_gpu."""
    update_weights_bucket_megabytes: int = 512
    """Size of the buckets in which weights are streamed into the engine."""
    max_staleness: int = 0
    """Policy versions a rollout may lag the actor: 0 = the synchronous on-policy loop (step k samples
    with the weights after step k-1); 1 = step k+1 is generated while step k trains (needs
    trainer.placement.rollout on ranks of its own, or partial_rollout). The engine's log-probs are kept
    when > 0."""
    partial_rollout: bool = False
    """Multi-turn: a step trains on the first data.train_batch_size prompts whose episodes (all
    rollout.n) have ended; the other episodes stop before their next model turn and go on in the next
    step under the new weights (each token keeps the policy version that sampled it; a prompt whose
    oldest token would lag the actor by more than max_staleness starts again). Needs max_staleness >= 1;
    docs/multi_turn.md."""
    partial_rollout_window: float = 1.25
    """With partial_rollout: prompts in flight at each step's start, in batches of data.train_batch_size
    (1.25: a quarter batch more than a step trains on, so its slowest episodes can go on into the next
    step while the step trains on those that ended); the sampler tops the window up as groups train."""
    calculate_log_probs: bool = False
    """Keep the engine's log-probs of the sampled tokens and log the rollout-training mismatch metrics
    (training/rollout_probs_diff_*, rollout_corr/*); on whenever algorithm.rollout_correction corrects."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling parameters of validation."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn and tool-calling rollouts (verl's actor_rollout_ref.rollout.multi_turn)."""

    @property
    def engine_ranks(self) -> int:
        """Ranks (GPUs) one SGLang engine spans: tensor_model_parallel_size x data_parallel_size."""
        return self.tensor_model_parallel_size * self.data_parallel_size

    @property
    def engine_layout(self) -> str:
        """The engine's layout for a log line: "TP=2", or "TP=2 x DP=2 (4 ranks), EP=4"."""
        text = f"TP={self.tensor_model_parallel_size}"
        if self.data_parallel_size > 1:
            text += f" x DP={self.data_parallel_size} ({self.engine_ranks} ranks)"
        return text + (f", EP={self.expert_parallel_size}" if self.expert_parallel_size > 1 else "")
