"""``genworker``: the demo and a JSONL generation command for your own models.

genworker demo [--shards N]                       # tiny local Llama, real vLLM engine
genworker generate --model DIR --prompts FILE     # JSONL {"prompt": ...} in, JSONL out
genworker serve --model DIR [--host H --port P]   # vLLM's OpenAI server, genworker's layer

``generate`` and ``serve`` write JSON lines only on stdout; logs (vLLM's too) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch

__all__ = ["main", "worker_config"]

DEMO_PROMPTS = (
    "The trainer hands the worker a batch of",
    "Once upon a time",
    "In reinforcement learning, a policy",
    "The quick brown fox",
    "Weights are refit after every step because",
    "A tiny model with random weights says",
    "Sleep mode frees memory so that",
    "Hello",
)


def worker_config(
    model: str, *, pad_token_id: int, max_new_tokens: int, temperature: float, device: str
) -> dict[str, object]:
    """A NeMo-RL generation config for ``model`` on this machine."""
    on_cpu = device == "cpu"
    return {
        "backend": "vllm",
        "model_name": model,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "_pad_token_id": pad_token_id,
        "seed": 0,
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "gpu_memory_utilization": 0.05 if on_cpu else 0.6,
            "max_model_len": 256 if on_cpu else 4096,
            "precision": "float32" if on_cpu else "bfloat16",
            "enforce_eager": on_cpu,
            "cap_max_tokens_to_context": True,
        },
        # On CPU, vLLM sizes the KV cache from the NUMA node's memory minus the process's,
        # which can go negative on a small machine: ask for a fixed 32 MiB instead.
        "vllm_kwargs": {"kv_cache_memory_bytes": 32 << 20} if on_cpu else {},
    }


def _pad(rows: Sequence[Sequence[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tokenizer(model: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _pad_id(tokenizer: object) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise SystemExit("the tokenizer has neither a pad nor an eos token: cannot pad a batch")
    return int(pad)


def _completions(
    out: dict[str, torch.Tensor], lengths: torch.Tensor, tokenizer: object
) -> list[str]:
    decode = tokenizer.decode  # type: ignore[attr-defined]
    texts = []
    for i in range(out["output_ids"].shape[0]):
        start = int(lengths[i])
        stop = start + int(out["generation_lengths"][i])
        texts.append(
            str(decode(out["output_ids"][i, start:stop].tolist(), skip_special_tokens=True))
        )
    return texts


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from genworker.shell.tiny_model import build_tiny_model

    t0 = time.perf_counter()
    model = build_tiny_model(Path(args.model))
    built = time.perf_counter() - t0
    tokenizer = _tokenizer(str(model))
    pad = _pad_id(tokenizer)
    config = worker_config(
        str(model),
        pad_token_id=pad,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        device=_device(),
    )
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.batch)]
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    t1 = time.perf_counter()
    if args.shards > 1:
        from genworker.shell.group import GenerationGroup, local_cluster

        runner: object = GenerationGroup(config, local_cluster(num_shards=args.shards))
    else:
        from genworker.shell.worker import VllmGenerationWorker

        runner = VllmGenerationWorker(config)
    started = time.perf_counter() - t1
    chunks = [
        list(range(i, min(i + args.chunk, len(rows)))) for i in range(0, len(rows), args.chunk)
    ]
    results: list[tuple[int, int, int, bool, str]] = []
    t2 = time.perf_counter()
    generated = 0
    try:
        for chunk in tqdm(chunks, desc="generating", unit="batch", file=sys.stderr):
            data = _pad([rows[i] for i in chunk], pad)
            out = runner.generate(data, greedy=args.greedy)  # type: ignore[attr-defined]
            texts = _completions(out, data["input_lengths"], tokenizer)
            generated += int(out["generation_lengths"].sum())
            for j, i in enumerate(chunk):
                results.append(
                    (
                        i,
                        len(rows[i]),
                        int(out["generation_lengths"][j]),
                        bool(out["truncated"][j]),
                        texts[j],
                    )
                )
        elapsed = time.perf_counter() - t2
    finally:
        runner.shutdown()  # type: ignore[attr-defined]
    print(f"{'#':>3}  {'prompt':<42} {'in':>3} {'out':>3} {'trunc':>5}  completion")
    for i, n_in, n_out, truncated, text in results:
        completion = "".join(c if c.isprintable() else "·" for c in text)[:60]
        print(f"{i:>3}  {prompts[i][:42]:<42} {n_in:>3} {n_out:>3} {truncated!s:>5}  {completion}")
    print(
        f"\nmodel {model} (built/cached in {built:.1f} s); engine start {started:.1f} s; "
        f"{len(rows)} prompts, {generated} tokens in {elapsed:.2f} s "
        f"({generated / max(elapsed, 1e-9):.0f} tokens/s, {args.shards} shard(s), {_device()})"
    )
    return 0


def _read_prompts(stream: TextIO) -> list[str]:
    prompts = []
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise SystemExit(f"line {n}: expected a JSON object with a non-empty 'prompt' string")
        prompts.append(prompt)
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from genworker.shell.worker import VllmGenerationWorker

    with open(args.prompts, encoding="utf-8") as f:
        prompts = _read_prompts(f)
    tokenizer = _tokenizer(args.model)
    pad = _pad_id(tokenizer)
    config = worker_config(
        args.model,
        pad_token_id=pad,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        device=_device(),
    )
    worker = VllmGenerationWorker(config)
    sink = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    try:
        for start in range(0, len(prompts), args.chunk):
            part = prompts[start : start + args.chunk]
            data = _pad([tokenizer(p)["input_ids"] for p in part], pad)
            out = worker.generate(data, greedy=args.greedy)
            for j, text in enumerate(_completions(out, data["input_lengths"], tokenizer)):
                record = {
                    "prompt": part[j],
                    "completion": text,
                    "prompt_tokens": int(data["input_lengths"][j]),
                    "generated_tokens": int(out["generation_lengths"][j]),
                    "truncated": bool(out["truncated"][j]),
                }
                sink.write(json.dumps(record) + "\n")
    finally:
        worker.shutdown()
        if sink is not sys.stdout:
            sink.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The async worker with its OpenAI server until SIGINT/SIGTERM: one JSON line
    ``{"base_url": ...}`` once it serves, ``{"stopped": true}`` once it stopped."""
    import asyncio
    import signal

    from genworker.shell.async_worker import AsyncVllmGenerationWorker

    config = worker_config(
        args.model,
        pad_token_id=_pad_id(_tokenizer(args.model)),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        device=_device(),
    )
    vllm_cfg = config["vllm_cfg"]
    assert isinstance(vllm_cfg, dict)
    vllm_cfg.update(
        async_engine=True,
        expose_http_server=True,
        http_server_host=args.host,
        http_server_port=args.port,
        http_server_on_policy_guard=not args.no_on_policy_guard,
    )
    if args.chat_template is not None:
        template = Path(args.chat_template).read_text(encoding="utf-8")
        vllm_cfg["http_server_serving_chat_kwargs"] = {"chat_template": template}

    async def serve() -> None:
        worker = AsyncVllmGenerationWorker(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await worker.start_http_server()
            print(json.dumps({"base_url": url}), flush=True)
            await stop.wait()
        finally:
            await worker.shutdown()
        print(json.dumps({"stopped": True}), flush=True)

    asyncio.run(serve())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for results
    parser = argparse.ArgumentParser(
        prog="genworker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate on a tiny local model with a real engine")
    demo.add_argument("--model", default="models/tiny-llama", help="where the tiny model lives")
    demo.add_argument("--shards", type=int, default=1, help="data-parallel shards (Ray)")
    demo.add_argument("--batch", type=int, default=16)
    gen = sub.add_parser("generate", help="JSONL prompts in, JSONL completions out")
    gen.add_argument("--model", required=True, help="a local Hugging Face model directory")
    gen.add_argument("--prompts", required=True, help='JSONL file of {"prompt": ...}')
    gen.add_argument("--out", help="output JSONL (default: stdout)")
    for p in (demo, gen):
        p.add_argument("--greedy", action="store_true")
        p.add_argument("--chunk", type=int, default=4, help="rows per generate call")
    serve = sub.add_parser("serve", help="vLLM's OpenAI server around the async worker")
    serve.add_argument("--model", required=True, help="a local Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0: any free port)")
    serve.add_argument("--chat-template", help="a Jinja chat template file")
    serve.add_argument(
        "--no-on-policy-guard", action="store_true", help="accept any sampling parameters"
    )
    for p in (demo, gen, serve):
        p.add_argument("--max-new-tokens", type=int, default=24)
        p.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    commands = {"demo": _demo, "generate": _generate, "serve": _serve}
    return commands[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
