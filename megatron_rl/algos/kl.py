"""KL estimators, KL coefficient controllers and the in-reward KL penalty.

The same estimators serve two config keys: ``algorithm.kl_penalty`` (KL subtracted from the token
rewards before advantage estimation, see ``apply_kl_penalty``) and
``actor_rollout_ref.actor.kl_loss_type`` (KL added to the actor loss). Names follow verl, including
the k1/k2/k3 aliases of John Schulman's estimators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from megatron_rl.algos.advantages import masked_mean

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "KL_PENALTIES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
]

_BASE_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = _BASE_ESTIMATORS + tuple(f"{name}+" for name in _BASE_ESTIMATORS)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from the sampled tokens' log-probs, shape of the inputs.

    - ``kl`` / ``k1``: ``logp - ref`` (unbiased, high variance, can be negative).
    - ``abs``: ``|logp - ref|``.
    - ``mse`` / ``k2``: ``0.5 * (logp - ref)^2``.
    - ``low_var_kl`` / ``k3``: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative); the log
      ratio is clamped to [-20, 20] before ``exp`` and the result to [-10, 10], as in verl.
    - ``<name>+`` (straight-through, e.g. ``k3+``): the value of ``<name>`` with the gradient of ``k2``,
      ``(logp - ref) * grad(logp)``, which is the gradient of the true KL in expectation; the k1 and k3
      gradients are biased as a loss (their estimates are unbiased only as values).
    """
    if kl_penalty.endswith("+") and kl_penalty[:-1] in _BASE_ESTIMATORS:
        value = _kl_value(logprob, ref_logprob, kl_penalty[:-1])
        k2 = 0.5 * (logprob - ref_logprob).square()
        return k2 - k2.detach() + value.detach()
    return _kl_value(logprob, ref_logprob, kl_penalty)


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        kld = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(kld, min=-10.0, max=10.0)
    raise ValueError(
        f"Unknown KL estimator {name!r} for `algorithm.kl_penalty` / "
        f"`actor_rollout_ref.actor.kl_loss_type`; valid choices: {', '.join(KL_PENALTIES)}."
    )


# apply_kl_penalty's parameter shadows the estimator's name inside its body.
_kl_estimate = kl_penalty


class KLController(Protocol):
    """What the trainer needs from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedKLController:
    """Constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepted for symmetry but not applied: a fixed coefficient comes from the config, so a resumed
        run with a changed ``algorithm.kl_ctrl.kl_coef`` uses the new value."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (``algorithm.kl_ctrl.type=adaptive``).

    After each batch, ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``:
    the coefficient grows while the measured KL is above target and shrinks while it is below.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for the adaptive controller."
            )
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for the adaptive controller.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the adapted coefficient; target and horizon stay as configured."""
        self.value = float(state["value"])


def get_kl_controller(
    kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller for ``algorithm.kl_ctrl`` (``type``, ``kl_coef``, ``target_kl``, ``horizon``)."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl and horizon.")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(
        f"Unknown KL controller {kl_ctrl_type!r} for `algorithm.kl_ctrl.type`; "
        "valid choices: fixed, adaptive."
    )


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the KL penalty from the token scores (``algorithm.use_kl_in_reward``).

    Args:
        token_level_scores: [B, T] reward-function scores (usually nonzero only at the last token).
        old_log_prob, ref_log_prob: [B, T] log-probs of the sampled tokens under the rollout and
            reference policies.
        response_mask: [B, T].
        kl_ctrl: controller whose ``value`` is the coefficient; updated in place with this batch's KL.
        kl_penalty: estimator name (``algorithm.kl_penalty``).
        group: data-parallel group; when given, the measured KL and the step count cover all ranks so
            that every rank's controller stays identical.

    Returns:
        token_level_rewards: [B, T] ``scores - beta * kl * mask``.
        metrics: ``actor/reward_kl_penalty`` (per-sequence masked mean KL, then mean over sequences) and
        ``actor/reward_kl_penalty_coeff`` (the beta used for this batch, before the update).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty).to(token_level_scores.dtype) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld

    seq_kl = masked_mean(kld.float(), mask.float(), dim=-1)  # [B]
    # [sum of per-sequence KL, number of sequences], summed over ranks.
    stats = torch.stack([seq_kl.sum(), torch.tensor(float(seq_kl.numel()), device=seq_kl.device)])
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    n_seqs = int(stats[1].item())
    current_kl = (stats[0] / max(n_seqs, 1)).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=n_seqs)
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
