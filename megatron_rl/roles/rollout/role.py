"""What the loop asks of a rollout role (:class:`RolloutRole`), what it generates from
(:class:`RolloutData`), what it is asked for (:class:`Request`) and with which sampling
(:func:`sampling_params`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import RolloutConfig
from megatron_rl.config.specs import RolloutSpec
from megatron_rl.rollout import Generation, SamplingParams
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import StateRegistry

if TYPE_CHECKING:
    from megatron_rl.data import PromptDataset

RequestKind = Literal["train", "val", "sync_check"]


@dataclass(frozen=True)
class Request:
    """One rollout the role is asked for: a training step's, a validation's, or the sync probe's
    (roles.sync_check). ``seq`` tells apart the separate rollout's validation requests of one step (the
    n-th it posts). ``str(request)`` is its name in log lines and its key in the job's store
    (``train/3``, ``val/3/1``)."""

    kind: RequestKind
    step: int
    seq: int | None = None

    @property
    def trains(self) -> bool:
        """A training step's rollout (the ones the queue holds and the episode statistics count)."""
        return self.kind == "train"

    def __str__(self) -> str:
        return f"{self.kind}/{self.step}" + ("" if self.seq is None else f"/{self.seq}")


@dataclass
class RolloutData:
    """What the role turns prompt indices into batches with."""

    train: PromptDataset
    """The training prompts."""
    val: PromptDataset | None
    """The validation prompts (data.val_files), if any."""
    pad_id: int
    stop_ids: list[int]
    keep_log_probs: bool
    """Ask the engine for its log-probs of the sampled tokens (mismatch metrics and corrections)."""


@runtime_checkable
class RolloutRole(Protocol):
    """What the loop asks of a rollout role, colocated or separate (the package's docstring)."""

    def start(self, step: int) -> None:
        """After a resume at ``step`` (0: a fresh run)."""

    def prompts(self, step: int) -> list[int]:
        """This DP rank's prompt indices of step ``step``."""

    def sampling(self, step: int, validate: bool) -> SamplingParams: ...

    def batch(
        self, step: int, prompt_indices: list[int], timer: Timer, validate: bool = False
    ) -> RolloutBatch:
        """The generations of these prompts as a batch, each row's meta.policy_version set."""

    def generate(
        self,
        request: Request,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        timer: Timer,
        items: list | None = None,
    ) -> tuple[list[list[Generation]], int]:
        """The generations of one request and the policy version that sampled them."""

    def policy_updated(self, step: int, timer: Timer) -> None:
        """Step ``step``'s update is done: the actor is version ``step``."""

    def staleness_metrics(self, batch: RolloutBatch) -> dict[str, float]: ...

    def step_metrics(self, step: int) -> dict[str, float]: ...

    def register_state(self, registry: StateRegistry) -> None: ...

    def shutdown(self) -> None: ...


def sampling_params(
    rollout: RolloutConfig, spec: RolloutSpec, stop_ids: list[int], step: int, validate: bool, logprobs: bool
) -> SamplingParams:
    """Sampling of step ``step``'s rollout (or of validation), seeded by (rollout.seed, step, validate); the
    engines derive each row's seed from these, its DP rank (colocated) or slice (separate) and its row
    (rollout.base.sample_seed); a training prompt gets ``spec.samples_per_draw`` of them."""
    if validate:
        vk = rollout.val_kwargs
        n, temperature, top_p, top_k, greedy = vk.n, vk.temperature, vk.top_p, vk.top_k, not vk.do_sample
    else:
        n, temperature, top_p, top_k = rollout.n, rollout.temperature, rollout.top_p, rollout.top_k
        n, greedy = spec.samples_per_draw, not rollout.do_sample
    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        greedy=greedy or temperature == 0,
        max_new_tokens=spec.max_new_tokens,
        stop_token_ids=stop_ids,
        seed=rollout.seed,
        step=step,
        validate=validate,
        return_logprobs=logprobs and not validate,
        return_routed_experts=spec.routed_experts and not validate,
    )
