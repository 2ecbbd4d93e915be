"""SGLang taking the actor's LoRA adapters in process (lora.merge=false, rollout.lora_sync), one GPU.

A bf16 Megatron actor (a small random Llama) with rank-8 adapters whose B is random (so they move the
policy); the engine is started with SGLang's LoRA support (config.lora.EngineLora, as the trainer
starts it for lora.merge=false). The first sync streams the base and loads the adapters; greedy outputs are
judged against transformers in fp32 on base + scale * B A (the PEFT-merged weights, the oracle):
teacher-forced, every token SGLang chose must be the oracle's argmax or within TIE logits of it, and
the engine's log-probs of its tokens must agree with the oracle's within the sync-integrity probe's
bf16 tolerance. After release_memory / resume_memory (the base kept) and a step's worth of adapter
change, a second sync sends the adapters alone and the outputs follow the new adapters. Negative
controls: the old outputs judged against the new oracle, and the base alone judged against it, fail.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu/test_sglang_lora.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.gpu.test_sglang import DIMS

pytestmark = pytest.mark.gpu
NEW = 12
TIE = 0.25  # logits (tests/gpu/test_sglang.py: the random models' near-ties)
PROBE_TOL = 0.1  # roles.sync_check's bf16 tolerance: mean |engine - actor| log-prob
RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from megatron_rl.config import RolloutConfig
    from megatron_rl.config.lora import LoraConfig, engine_lora
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.lora import add_adapters
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine

    root = tmp_path_factory.mktemp("models")
    path = save_random_hf_model(str(root / "a"), "llama", seed=1, **DIMS)
    ps = init_parallel(1, 1, device="cuda")
    args = load_model_args(path)
    model = build_model(args, ps, dtype=torch.bfloat16, options=TrainingOptions(lora=True))  # local layers
    load_hf_weights(model, path, ps)
    spec = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"], merge=False)
    add_adapters(model, spec, ps, "actor_rollout_ref.model.lora", path, seed=0)
    move_adapters(model, seed=1)
    cfg = RolloutConfig(
        name="sglang",
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        enable_cuda_graph=True,
        max_num_batched_tokens=4096,
    )
    engine = create_engine(cfg, path, args, ps, seed=0, cuda_graph_max_bs=32, lora=engine_lora(spec))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, DIMS["vocab_size"], (32, 10), generator=g).tolist()
    greedy = SamplingParams(greedy=True, max_new_tokens=NEW, return_logprobs=True)
    yield SimpleNamespace(path=path, ps=ps, model=model, engine=engine, prompts=prompts, greedy=greedy)
    engine.shutdown()
    destroy_parallel()


@torch.no_grad()
def move_adapters(model, seed: int) -> None:
    """Random B (and a nudge to A): the adapters change the policy, as training would."""
    from megatron_rl.models.lora import adapters

    g = torch.Generator(device="cuda").manual_seed(seed)
    for _, a in adapters(model):
        a.B.copy_(0.05 * torch.randn(a.B.shape, generator=g, device="cuda"))
        a.A.add_(0.02 * torch.randn(a.A.shape, generator=g, device="cuda"))


def oracle(env, with_adapters: bool = True):
    """transformers in fp32 on the bf16 base + scale * B A (the merged weights the actor runs)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.lora_files import gather_peft

    ref = AutoModelForCausalLM.from_pretrained(env.path, dtype=torch.bfloat16).cuda().float().eval()
    if with_adapters:
        tensors = gather_peft(env.model, env.ps)
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith(".lora_A.weight"):
                    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = tensors[key.replace(".lora_A.", ".lora_B.")]
                    ref.get_submodule(module).weight += ALPHA / RANK * (b.float() @ a.float())
    return ref


@torch.no_grad()
def judge(ref, prompts: list[list[int]], gens) -> dict:
    """Teacher-forced: argmax share, worst gap (logits) and mean |log-prob difference| of the outputs."""
    x = torch.tensor(prompts, device="cuda")
    y = torch.tensor([per[0].token_ids for per in gens], device="cuda")
    logits = ref(torch.cat([x, y], dim=1)).logits[:, x.shape[1] - 1 : -1]  # [B, new, V]
    gap = logits.max(-1).values - logits.gather(-1, y[..., None])[..., 0]
    lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]
    engine_lp = torch.tensor([per[0].logprobs for per in gens], device="cuda")
    return {
        "argmax": (gap == 0).float().mean().item(),
        "worst_gap": gap.max().item(),
        "logprob_diff_mean": (lp - engine_lp).abs().mean().item(),
    }


def ok(res: dict) -> bool:
    return res["worst_gap"] < TIE and res["argmax"] >= 0.9 and res["logprob_diff_mean"] < PROBE_TOL


def test_adapters_into_sglang_without_the_base(env):
    from megatron_rl.rollout.reshard import sync_weights

    first = sync_weights(env.model, env.ps, env.engine, bucket_megabytes=1, dtype=torch.bfloat16)
    assert first["buckets"] >= 1 and first["adapter_bytes"] > 0
    assert first["bytes"] > 5 * first["adapter_bytes"]  # the base went too
    out1 = env.engine.generate(env.prompts, env.greedy)
    res = judge(oracle(env), env.prompts, out1)
    print(f"first sync {first}; SGLang with adapters vs the merged oracle: {res}")
    assert ok(res), res
    base_only = judge(oracle(env, with_adapters=False), env.prompts, out1)
    assert not ok(base_only), f"the adapters changed nothing: {base_only}"

    env.engine.release_memory()  # training: KV cache and graphs go, the base stays
    env.engine.resume_memory()
    move_adapters(env.model, seed=2)  # a step's worth
    second = sync_weights(env.model, env.ps, env.engine, bucket_megabytes=1, dtype=torch.bfloat16)
    print(f"second sync {second}")
    assert second["bytes"] == second["adapter_bytes"] and second["buckets"] == 0
    out2 = env.engine.generate(env.prompts, env.greedy)
    new = oracle(env)
    res2 = judge(new, env.prompts, out2)
    print(f"after the second sync: {res2}")
    assert ok(res2), res2
    stale = judge(new, env.prompts, out1)  # negative control: the old adapters' outputs
    assert not ok(stale) and stale["argmax"] < 0.5, stale
