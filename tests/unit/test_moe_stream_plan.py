"""The expert half of the reshard stream, in one process: the bucket plan names every tensor of a
mixture-of-experts checkpoint once (whatever EP / expert TP), and the transformers engine's fused
expert parameters are reached under those names as views of their storage."""

import pytest
import torch

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import random_hf_model
from megatron_rl.rollout.reshard import plan_buckets
from megatron_rl.weights.tables import hf_shapes, module_param_views

ARCHS = {"qwen3_moe": dict(mlp_only_layers=[1]), "mixtral": {}}


def tiny(arch: str):
    model = random_hf_model(arch, seed=1, num_hidden_layers=2, **ARCHS[arch])
    hf = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    return model, model_args_from_hf_config(hf)


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes (transformers converts fused experts back on save)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_file(f"{d}/model.safetensors")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 2), (2, 1)])
def test_plan_streams_every_expert_once_under_checkpoint_names(arch, tp, etp):
    model, args = tiny(arch)
    files = checkpoint_tensors(model)
    plan = plan_buckets(args, tp, 1, 8192, itemsize=4, etp=etp)
    names = [t.name for b in plan for s in b.params for t in s.tensors]
    assert len(names) == len(set(names)) and set(names) == set(files)
    shapes = hf_shapes(args)
    assert all(tuple(files[n].shape) == shapes[n] for n in names)
    experts = {s.layout.expert for b in plan for s in b.params if s.layout.expert is not None}
    assert experts == set(range(args.num_experts))
    for b in plan:
        for s in b.params:
            if s.layout.expert is not None:  # expert shards map over expert TP, not TP
                assert len(s.layout.pieces) == etp


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_experts_are_views_under_checkpoint_names(arch):
    model, args = tiny(arch)
    files = checkpoint_tensors(model)
    params = dict(model.named_parameters())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in params)  # transformers >= 5 fuses them
    views = module_param_views(args, params)
    assert sorted(views) == sorted(files)
    for name, t in files.items():
        assert torch.equal(views[name], t), name
    # writing through a view writes the model's parameter
    gate = "model.layers.0.mlp.experts.2.gate_proj.weight"
    if arch == "mixtral":
        gate = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
    with torch.no_grad():
        views[gate].fill_(7.0)
    f = args.moe_ffn_hidden_size
    assert bool((params["model.layers.0.mlp.experts.gate_up_proj"][2, :f] == 7.0).all())
    assert not bool((params["model.layers.0.mlp.experts.gate_up_proj"][2, f:] == 7.0).any())
