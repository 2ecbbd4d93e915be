"""verl's ``override_transformer_config.recompute_modules`` reaches megatron-core: from the command line
through the config and the role's model builder, the named modules are recomputed in the backward
pass (they run twice) and the gradients are those of the model without recompute."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config

IDS = torch.randint(3, 99, (4, 6), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", num_hidden_layers=1)


def _grads_and_mlp_calls(ps, hf_dir, overrides: list[str]) -> tuple[torch.Tensor, int]:
    from megatron_rl import cpu_bridge
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.forward import causal_padding_mask
    from megatron_rl.roles.models import _model

    mcfg = load_config(None, overrides).actor_rollout_ref.actor.megatron
    m = _model(ps, load_model_args(hf_dir), "actor", hf_dir, mcfg, recompute=True)
    m.train()
    calls = [0]
    m.get_submodule("decoder.layers.0.mlp").register_forward_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    with cpu_bridge.device_mode():
        out = m(IDS, None, causal_padding_mask(torch.ones_like(IDS)))
    out.float().logsumexp(-1).mean().backward()
    return torch.cat([p.grad.flatten() for p in m.parameters()]), calls[0]


def test_recompute_modules_reach_the_transformer_config(ps, hf_dir):
    key = "actor_rollout_ref.actor.megatron.recompute_granularity=selective"
    plain, once = _grads_and_mlp_calls(ps, hf_dir, [key])  # selective: the attention core only
    prefix = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    grads, twice = _grads_and_mlp_calls(ps, hf_dir, [key, prefix + "recompute_modules=[core_attn,mlp]"])
    assert (once, twice) == (1, 2)  # the MLP is recomputed only when verl's key names it
    assert torch.equal(plain, grads)
