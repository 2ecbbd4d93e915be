"""The expert half of the reshard stream, in one process: the bucket plan names every tensor of a
mixture-of-experts checkpoint once (whatever EP / expert TP), and the transformers engine's fused
expert parameters are reached under those names as views of their storage."""

import pytest
import torch

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import random_hf_model
from megatron_rl.rollout.bucket_plan import plan_buckets
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bucket_bytes", [40_000, 1 << 30])
def test_stacks_view_every_expert_in_an_engines_fused_layout(arch, bucket_bytes):
    """Each bucket's experts are laid out so that one view per layer and projection covers them:
    w13 [n, 2F, H] = [gate_e; up_e] per expert, w2 [n, H, F] = down_e; small buckets split a layer."""
    from megatron_rl.rollout.bucket_plan import make_bucket

    _, args = tiny(arch)
    h, f = args.hidden_size, args.moe_ffn_hidden_size
    plan = plan_buckets(args, 1, 1, bucket_bytes, itemsize=4)
    covered = []
    for b in plan:
        bucket = make_bucket(b, torch.randn(b.numel))
        tensors = dict(bucket)
        for st, view in bucket.stacks:
            covered += st.names
            if st.proj == "w13":  # names: gate_e, up_e, gate_e+1, ...
                pairs = [st.names[k : k + 2] for k in range(0, len(st.names), 2)]
                want = [torch.cat([tensors[g], tensors[u]]) for g, u in pairs]
                firsts = [g for g, _ in pairs]
            else:
                want = [tensors[n] for n in st.names]
                firsts = list(st.names)
            assert view.shape == ((len(want), 2 * f, h) if st.proj == "w13" else (len(want), h, f))
            assert torch.equal(view, torch.stack(want))
            assert all(f".experts.{st.first + k}." in n for k, n in enumerate(firsts))
    experts = [t.name for b in plan for s in b.params if s.layout.expert is not None for t in s.tensors]
    assert sorted(covered) == sorted(experts)
    if bucket_bytes < 1 << 30:
        assert any(len(st.names) < 2 * args.num_experts for b in plan for st in b.stacks)  # a split layer


@pytest.mark.parametrize("bucket_bytes", [40_000, 1 << 30])
def test_grouped_and_sequential_experts_stream_the_same_buckets(ps, tmp_path, monkeypatch, bucket_bytes):
    """The stream of GroupedExperts (a stack's run copied from the stacked weight at once) and of
    SequentialMLP (expert by expert) hold the checkpoint's tensors, bit for bit."""
    from safetensors.torch import load_file

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.rollout import reshard
    from megatron_rl.rollout.reshard import iter_hf_buckets

    path = save_random_hf_model(str(tmp_path / "m"), "qwen3_moe", seed=2, num_hidden_layers=2)
    files = load_file(f"{path}/model.safetensors")
    args = load_model_args(path)
    per_expert = reshard._gather_experts

    def not_grouped(*a, **kw):  # GroupedExperts at expert TP 1 must take the stacked path
        raise AssertionError("grouped experts streamed expert by expert")

    for grouped in (True, False):
        monkeypatch.setattr(reshard, "_gather_experts", not_grouped if grouped else per_expert)
        model = build_model(args, ps, options=TrainingOptions(moe_grouped_gemm=grouped))
        load_hf_weights(model, path, ps)
        seen = 0
        for bucket in iter_hf_buckets(model, ps, bucket_bytes, torch.float32):
            for name, t in bucket:
                assert torch.equal(t, files[name]), f"{name} (grouped={grouped})"
                seen += 1
        assert seen == len(files) - args.tie_embeddings
