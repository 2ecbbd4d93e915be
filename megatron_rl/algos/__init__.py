"""Pure tensor functions for PPO: tensors in, tensors out, masked by ``response_mask``.

Token-level tensors are shaped ``[batch, response_len]``; ``response_mask`` is 1.0 on real response tokens
and 0.0 on padding after EOS. Data flows through the modules in this order:

1. ``token_level_scores`` from the reward function
2. ``kl.apply_kl_penalty`` (optional, ``algorithm.use_kl_in_reward``) -> ``token_level_rewards``
3. ``advantages.get_adv_estimator(algorithm.adv_estimator)`` -> ``advantages`` and ``returns``
4. ``policy_loss.compute_policy_loss`` (actor, one of ``POLICY_LOSSES``; plus ``kl.kl_penalty`` as a KL
   loss), weighted by ``rollout_corr`` importance weights when the mismatch correction is on, and
   ``losses.compute_value_loss`` (critic), each reduced by ``losses.agg_loss``

Names and semantics follow verl. Importing this package needs only torch.
"""

from megatron_rl.algos.advantages import (
    ADV_ESTIMATORS,
    compute_gae,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    masked_mean,
    masked_var,
    masked_whiten,
)
from megatron_rl.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from megatron_rl.algos.losses import LOSS_AGG_MODES, agg_loss, compute_value_loss
from megatron_rl.algos.policy_loss import (
    POLICY_LOSSES,
    PolicyLossOptions,
    compute_policy_loss,
    effective_agg_mode,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PolicyLossOptions",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_gae",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "effective_agg_mode",
    "get_adv_estimator",
    "get_kl_controller",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]
