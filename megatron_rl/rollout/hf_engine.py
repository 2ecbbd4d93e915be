"""Transformers rollout engine: the CPU default (works on a GPU too), filled by the reshard stream.

Each DP leader (tp_rank 0, pp_rank 0) hosts an ``AutoModelForCausalLM`` built from the model's
config alone (``from_config``: no weight file is read) in the rollout dtype; its weights arrive only
through :func:`megatron_rl.rollout.reshard.sync_weights`. The other ranks host nothing: they take
part in the stream's collectives and receive their replica's generations by broadcast
(:func:`megatron_rl.rollout.base.collective_generate`).

Generation is a plain KV-cached decoding loop over left-padded batches of ``max_batch_size`` rows:
prompt i's n samples are rows i*n .. i*n+n-1; each row draws from its own ``torch.Generator``
seeded with :func:`~megatron_rl.rollout.base.sample_seed` (seed, step, dp_rank, row, validate), so a
run with the same seed and the same prompts is bit-identical on CPU, whatever the batch size.
Per step: logits [B, V] (fp32) -> greedy argmax, or temperature -> top-k -> top-p ->
multinomial. Log-probs, when asked, are log_softmax(logits / temperature) of the chosen token
(log_softmax(logits) for greedy), i.e. before top-k/top-p truncation, as the trainer computes them.
With ``return_routed_experts`` (MoE routing replay) a hook on each MoE block's router keeps the top-k
expert ids of every forward: prefill and decode steps together give each row's
[prompt + response - 1, L, k] (models/routing.py).

release_memory/resume_memory move the weights to the host and back on a GPU; on the CPU they are
no-ops (nothing to give back).

LoRA unmerged (rollout.lora_sync): :meth:`HFEngine.load_adapters` takes the actor's adapters in PEFT's
names; each adapted projection (``q_proj`` ... ``down_proj``, an ``nn.Linear``) then returns
W x + b + (alpha / r) B (A x) through a forward hook (:class:`HFAdapters`), in the engine's dtype, as
the trainer computes it beside megatron's linears. The base stays as the first sync streamed it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_rl import seeds
from megatron_rl.model_args import ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.base import (
    Bucket,
    Generation,
    Origins,
    SamplingParams,
    collective_generate,
    gloo_twin,
    row_seeds,
)


def build_hf_model(
    args: ModelArgs, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """An HF causal LM of ``args``' architecture from its config.json contents (random weights)."""
    import transformers

    hf = dict(args.hf_config)
    if "model_type" not in hf:
        raise ValueError("the model's config.json has no 'model_type'; cannot build the transformers engine")
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation
        )
    return model.eval().requires_grad_(False)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] logits -> temperature-scaled logits with everything outside top-k / top-p at -inf.

    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (the most
    likely token always survives).
    """
    x = logits / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] fp32 logits -> (token ids [B], their log-probs [B]) as described in the module doc.

    ``generator``: one for the whole batch, or one per row (row b draws from ``generator[b]`` only, so
    its tokens do not depend on the other rows of the batch).
    """
    if params.is_greedy:
        tok = logits.argmax(dim=-1)
        return tok, torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None])[:, 0]
    scaled = logits / params.temperature
    probs = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
    if isinstance(generator, torch.Generator):
        tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:
        if len(generator) != probs.shape[0]:
            raise ValueError(f"{len(generator)} generators for {probs.shape[0]} rows")
        tok = torch.cat(
            [torch.multinomial(probs[b : b + 1], 1, generator=g)[0] for b, g in enumerate(generator)]
        )
    return tok, torch.log_softmax(scaled, dim=-1).gather(-1, tok[:, None])[:, 0]


def cut_response(tokens: list[int], logprobs: list[float], stop: set[int]) -> Generation:
    """Keep tokens up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return Generation(tokens[: i + 1], logprobs[: i + 1], "stop")
    return Generation(tokens, logprobs, "length")


class HFEngine:
    """Rollout with transformers on each DP leader; see the module docstring."""

    def __init__(
        self,
        args: ModelArgs,
        ps: ParallelState,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_batch_size: int = 64,
        attn_implementation: str = "sdpa",
    ) -> None:
        self.args, self.ps, self.dtype, self.seed = args, ps, dtype, seed
        self.max_batch_size = max_batch_size
        self.device = ps.device
        self.model = (
            build_hf_model(args, dtype, self.device, attn_implementation) if ps.is_dp_leader else None
        )
        self._mp_group = gloo_twin(ps, ps.mp_group)
        self.pad_id = int(args.hf_config.get("pad_token_id") or 0)
        self._synced = False
        self._ever_set: set[str] = set()  # parameters some sync has filled
        self._unseeded_calls = 0  # requests without a seed draw from (engine seed, call number)
        self.adapters: HFAdapters | None = None  # LoRA unmerged: the actor's adapters (rollout.lora_sync)
        self.adapter_base = False  # rollout.lora_sync: the base has been streamed into this engine

    takes_adapters = True
    """LoRA adapters can be loaded apart from the base (:meth:`load_adapters`)."""

    @torch.no_grad()
    def load_adapters(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """The actor's adapters (PEFT names, full tensors; ``config``: PEFT's adapter_config) replace the
        ones held; the DP leader applies them from the next generate on, the other ranks hold nothing."""
        if self.model is None:
            return
        if self.adapters is None:
            self.adapters = HFAdapters(self.model)
        self.adapters.load(tensors, float(config["lora_alpha"]) / int(config["r"]), self.dtype)

    # -- weights ---------------------------------------------------------------------------------

    def _stream_targets(self) -> dict[str, torch.Tensor]:
        """The model's parameters under the stream's (checkpoint) names: fused experts as per-expert views,
        and the expert-score biases of sigmoid routers (buffers)."""
        from megatron_rl.weights.tables import module_param_views

        assert self.model is not None  # the DP leader's
        params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        params.update((n, b) for n, b in self.model.named_buffers() if n.endswith("e_score_correction_bias"))
        return module_param_views(self.args, params)

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[Bucket]) -> None:
        params = self._stream_targets() if self.model is not None else {}
        seen: set[str] = set()
        for bucket in buckets:  # every rank drains the stream: it drives the collectives
            if self.model is None:
                continue
            for name, tensor in bucket:
                p = params.get(name)
                if p is None:
                    raise KeyError(f"weight stream sent {name!r}, which the transformers model does not have")
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: stream shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
                p.copy_(tensor)
                seen.add(name)
        if self.model is not None:
            # Never filled by any sync: the stream and the model disagree on names. A parameter a later
            # sync leaves stale is the integrity check's to report (reshard.check_weights).
            self._ever_set |= seen
            missing = sorted(set(params) - self._ever_set)
            if missing:
                raise RuntimeError(f"weight stream left {len(missing)} parameters unset, e.g. {missing[:5]}")
        self._synced = True

    @property
    def checks_weights(self) -> bool:
        """This rank holds a model whose weights :meth:`weight_checksums` reads back."""
        return self.model is not None

    @torch.no_grad()
    def weight_checksums(self, names: list[str]) -> dict[str, torch.Tensor]:
        """[CHECKSUM_SIZE] float64 checksums (rollout.checksums) of this engine's copy of ``names``."""
        from megatron_rl.rollout.checksums import tensor_checksum

        params = self._stream_targets()
        return {n: tensor_checksum(params[n]) for n in names if n in params}

    def release_memory(self) -> None:
        if self.model is not None and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.model is not None and self.device.type == "cuda":
            self.model.to(self.device)

    def shutdown(self) -> None:
        self.model = None

    # -- generation ------------------------------------------------------------------------------

    def host_ready(self) -> None:
        """Raise unless this rank hosts the model and it holds synced weights (what generating needs)."""
        if self.model is None:
            raise RuntimeError("generation asked of a rank that hosts no transformers model")
        if not self._synced:
            raise RuntimeError("generate() before the first update_weights(): call sync_weights first")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        run = None
        if self.model is not None:
            self.host_ready()
            run = lambda flat, origins: self.generate_local(flat, origins, params)  # noqa: E731
        return collective_generate(self.ps, prompts, params, None, self._mp_group, run)

    @torch.no_grad()
    def generate_local(
        self, prompts: list[list[int]], origins: Origins, params: SamplingParams
    ) -> list[list[Generation]]:
        """On the hosting rank: ``params.n`` generations of each prompt; ``origins``: each prompt's
        (dp_rank, row), which picks its rows' seeds (so a row's tokens do not depend on its batch)."""
        fallback = seeds.derive(seeds.ENGINE_CALL, self.seed, self._unseeded_calls)  # for params.seed
        if params.seed is None:
            self._unseeded_calls += 1
        gens = [
            torch.Generator(device=self.device).manual_seed(s) for s in row_seeds(params, origins, fallback)
        ]
        rows = [p for p in prompts for _ in range(params.n)]
        outs: list[Generation] = []
        for i in range(0, len(rows), self.max_batch_size):
            b = slice(i, i + self.max_batch_size)
            outs += self._generate_rows(rows[b], params, gens[b])
        return [outs[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_rows(
        self, rows: list[list[int]], params: SamplingParams, gen: list[torch.Generator]
    ) -> list[Generation]:
        if any(len(r) == 0 for r in rows):
            raise ValueError("empty prompt passed to generate()")
        b, plen = len(rows), max(len(r) for r in rows)
        ids = torch.full((b, plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, plen), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: the last prompt token of every row is at -1
            ids[i, plen - len(r) :] = torch.tensor(r)
            mask[i, plen - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        recorder = _RoutingRecorder(self.model) if params.return_routed_experts else None
        try:
            toks, lps = self._decode(ids, mask, params, gen)
        finally:
            if recorder is not None:
                recorder.remove()
        tok_rows = torch.stack(toks, dim=1).tolist()
        lp_rows = torch.stack(lps, dim=1).tolist()
        stop_set = set(params.stop_token_ids)
        routed = None if recorder is None else recorder.result(b)  # [b, plen + fed, L, k]
        res = []
        for i, (t, lp) in enumerate(zip(tok_rows, lp_rows, strict=True)):
            g = cut_response(t, lp, stop_set)
            if not params.return_logprobs:
                g.logprobs = None
            if routed is not None:  # this row's prompt, then its response but the last token
                g.routed_experts = routed[i, plen - len(rows[i]) : plen + len(g.token_ids) - 1].clone()
            res.append(g)
        return res

    def _decode(
        self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, gen: list[torch.Generator]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """KV-cached sampling from left-padded ``ids`` [b, plen]: the tokens and log-probs of each step
        ([b] each), until every row has stopped or max_new_tokens."""
        assert self.model is not None  # generation runs only where the model is hosted (generate_local)
        b = ids.shape[0]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # positions count real tokens only, as HF generate does
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        toks, lps = [], []
        last = pos[:, -1]
        for step in range(params.max_new_tokens):
            tok, lp = sample_next(logits, params, gen)
            toks.append(tok)
            lps.append(lp)
            done |= torch.isin(tok, stop)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            last = last + 1
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=last[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        return toks, lps


class HFAdapters(torch.nn.Module):
    """LoRA on an HF model's projections through forward hooks: module ``m`` with adapter (A [r, in],
    B [out, r]) returns m(x) + scale * (x A^T) B^T. A submodule of the model, so its tensors move with
    the model's ``.to()``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model_ref = [model]  # not a submodule: the model holds this module, not the reverse
        self.hooked: dict[str, object] = {}  # projection name -> its hook's handle
        self.scale = 1.0
        model.add_module("megatron_rl_lora", self)

    def load(self, tensors: dict[str, torch.Tensor], scale: float, dtype: torch.dtype) -> None:
        model = self.model_ref[0]
        self.scale = scale
        device = next(model.parameters()).device
        names = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in tensors})
        for name in set(self.hooked) - set(names):  # an adapter no longer sent: its projection is base
            self.hooked.pop(name).remove()  # type: ignore[attr-defined]
        for i, name in enumerate(names):
            key = f"base_model.model.{name}"
            for which in ("A", "B"):
                t = tensors[f"{key}.lora_{which}.weight"].to(device=device, dtype=dtype)
                self.register_buffer(f"{which}{i}", t.clone(), persistent=False)
            if name in self.hooked:
                self.hooked.pop(name).remove()  # type: ignore[attr-defined]
            self.hooked[name] = model.get_submodule(name).register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def add(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            a, b = getattr(self, f"A{i}"), getattr(self, f"B{i}")
            return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b) * self.scale

        return add

    def remove(self) -> None:
        """Every hook off: the model is its base again."""
        for handle in self.hooked.values():
            handle.remove()  # type: ignore[attr-defined]
        self.hooked.clear()


class _RoutingRecorder:
    """Hooks on each MoE block's experts (``layer.mlp.experts``, called as ``experts(hidden, top-k ids,
    top-k weights)`` by every transformers MoE block: Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5,
    DeepSeek-V3) collecting the top-k ids of every forward of one decode."""

    def __init__(self, model) -> None:
        layers = model.model.layers
        self.calls: list[list[torch.Tensor]] = [[] for _ in layers]
        self.k = 0
        self.handles = []
        for i, layer in enumerate(layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None:
                self.handles.append(experts.register_forward_pre_hook(self._hook(i)))
        if not self.handles:
            raise ValueError(
                "return_routed_experts: the transformers model has no MoE experts (layer.mlp.experts)"
            )

    def _hook(self, i: int):
        def record(module, args) -> None:
            ids = args[1]  # [b * s, k]
            self.k = ids.shape[-1]
            self.calls[i].append(ids.to(torch.int16).cpu())

        return record

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def result(self, b: int) -> torch.Tensor:
        """[b, tokens read, L, k]: prefill columns, then one per decode step; -1 on dense layers."""
        per_layer: list[torch.Tensor | None] = []
        for calls in self.calls:
            if calls:
                per_layer.append(torch.cat([c.view(b, -1, self.k) for c in calls], dim=1))
            else:
                per_layer.append(None)
        width = next(x for x in per_layer if x is not None).shape[1]
        dense = torch.full((b, width, self.k), -1, dtype=torch.int16)
        return torch.stack([dense if x is None else x for x in per_layer], dim=2)
