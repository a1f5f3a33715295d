"""The NeMo-RL integration test's driver process (``test_nemo_rl_integration`` runs it in
the test's own environment, ``nemo_rl_site/sitecustomize.py``): NeMo-RL's own
``RayVirtualCluster(use_gpus=False)``, ``VllmGeneration`` with its worker class pointed at
genworker's drop-ins as docs/nemo-rl.md says, grpo.py's ``refit_policy_generation`` and
rollouts.py's ``generate_responses`` / ``generate_responses_async``, on ``ray.init(num_cpus=2)``.

It records what it saw, per scenario, as JSON (``argv[1]``: the tiny model A's folder,
``argv[2]``: model B's, ``argv[3]``: the report path); the test asserts on the record.
A scenario that raises is recorded with its traceback and the next one still runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from nemo_rl_policy import StandInPolicy, cpu_device_id

GENWORKER = {
    False: "genworker.shell.nemo_rl.VllmGenerationWorker",
    True: "genworker.shell.nemo_rl.VllmAsyncGenerationWorker",
}
PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 0 1 2", "Hello world"]
MAX_NEW = 24
IN_FLIGHT_ROWS = 6
IN_FLIGHT_NEW = 384
IN_FLIGHT_AFTER_S = 0.5  # the refit starts this long after the rows are sent


def switch_to_genworker() -> None:
    """docs/nemo-rl.md's "Switching", as a NeMo-RL user writes it in the driver."""
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY  # type: ignore[import-not-found]
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES  # type: ignore[import-not-found]
    from nemo_rl.models.generation.vllm import vllm_generation  # type: ignore[import-not-found]

    for path in GENWORKER.values():
        ACTOR_ENVIRONMENT_REGISTRY[path] = PY_EXECUTABLES.SYSTEM  # this venv's python
    vllm_generation.resolve_generation_worker_cls = lambda default, config: GENWORKER[
        bool(config["vllm_cfg"]["async_engine"])
    ]


def generation_config(
    model: Path, tokenizer: Any, *, async_engine: bool, max_new: int, **top: Any
) -> Any:
    """NeMo-RL's generation section for the tiny model on CPU (its unit tests' shape:
    ``tokenizer`` and ``dtype`` beside the generation keys), through NeMo-RL's own
    ``configure_generation_config`` (dummy weights until the first refit)."""
    from helpers import cpu_engine_config
    from nemo_rl.models.generation import configure_generation_config  # type: ignore[import-not-found]

    cfg = cpu_engine_config(
        async_engine=async_engine,
        model=str(model),
        max_model_len=512,
        max_new_tokens=max_new,
        pad=0,
        **top,
    )
    del cfg["_pad_token_id"]  # NeMo-RL sets it from the tokenizer
    cfg["tokenizer"] = {"name": str(model)}
    cfg["dtype"] = "float32"
    cfg.update(val_temperature=1.0, val_top_p=1.0, val_top_k=None)
    cfg["vllm_cfg"].update(
        expert_parallel_size=1,
        skip_tokenizer_init=False,  # stop strings and text prompts need the engine's tokenizer
        kv_cache_dtype="auto",
        reset_encoder_cache_after_weight_update=False,
    )
    cfg["colocated"] = {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}}
    return configure_generation_config(cfg, tokenizer)


def prompt_batch(tokenizer: Any, prompts: list[str], stop_strings: list[Any] | None = None) -> Any:
    """rollouts.py's inputs: the generation data and the rollout batch (message logs)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # type: ignore[import-not-found]

    rows = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    data = BatchedDataDict({"input_ids": ids, "input_lengths": lengths})
    batch = BatchedDataDict({"message_log": [[{"role": "user", "content": p}] for p in prompts]})
    if stop_strings is not None:
        batch["stop_strings"] = stop_strings
    return data, batch, lengths


def generated(batch: Any) -> list[dict[str, Any]]:
    """Each row's assistant message (``token_ids``, ``generation_logprobs``, ``content``)."""
    return [log[-1] for log in batch["message_log"]]


def logprob_gap(policy: StandInPolicy, data: Any, batch: Any) -> float:
    """The largest gap between the engine's logprobs and the trainer's on the same tokens."""
    sequences, starts, engine = [], [], []
    for i, message in enumerate(generated(batch)):
        n = int(data["input_lengths"][i])
        sequences.append(data["input_ids"][i, :n].tolist() + message["token_ids"].tolist())
        starts.append(n)
        engine.append(message["generation_logprobs"].tolist())
    trainer = policy.get_logprobs(sequences, starts)
    return max(
        abs(float(a) - float(b))
        for e, t in zip(engine, trainer, strict=True)
        for a, b in zip(e, t, strict=True)
    )


def expected_lengths(tokenizer: Any, tokens: list[list[int]], strings: list[Any]) -> list[int]:
    """Where each row stops on ``strings[i]`` (None: runs to its end): the first prefix
    whose text holds one of them, from the row's unstopped greedy tokens."""
    out = []
    for row, wanted in zip(tokens, strings, strict=True):
        stop = len(row)
        for k in range(1, len(row) + 1):
            text = tokenizer.decode(row[:k], skip_special_tokens=True)
            if wanted and any(s in text for s in wanted):
                stop = k
                break
        out.append(stop)
    return out


def pick_stop_strings(tokenizer: Any, tokens: list[list[int]]) -> list[Any]:
    """Per-row stop strings where the two modes part: one row carries a string it
    generates after a few tokens, which another row (with no strings of its own) also
    generates before its end, so ``per_sample`` and ``batch_union`` give other lengths."""
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    for width in (3, 2, 1):
        for row, text in enumerate(texts):
            for start in range(2, len(text) - width):
                stop = text[start : start + width]
                if not stop.strip() or "\ufffd" in stop or not stop.isprintable():
                    continue
                strings: list[Any] = [[stop] if r == row else None for r in range(len(tokens))]
                own = expected_lengths(tokenizer, tokens, strings)
                union = expected_lengths(tokenizer, tokens, [[stop]] * len(tokens))
                if own[row] < len(tokens[row]) and own != union:
                    return strings
    raise AssertionError(f"no stop string parts the two modes: {texts!r}")


class Run:
    def __init__(self, model_a: Path, model_b: Path) -> None:
        from nemo_rl.algorithms.utils import get_tokenizer  # type: ignore[import-not-found]
        from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

        self.a, self.b = model_a, model_b
        self.tokenizer = get_tokenizer({"name": str(model_a)})
        self.cluster = RayVirtualCluster(
            bundle_ct_per_node_list=[1], use_gpus=False, num_gpus_per_node=1
        )
        self.policy = StandInPolicy(model_a)
        self.report: dict[str, Any] = {}

    def scenario(self, name: str, body: Callable[[dict[str, Any]], None]) -> None:
        seen: dict[str, Any] = {}
        started = time.monotonic()
        try:
            body(seen)
            seen["error"] = None
        except BaseException:  # noqa: BLE001 - recorded; the test fails on it
            seen["error"] = traceback.format_exc()
        seen["seconds"] = round(time.monotonic() - started, 1)
        self.report[name] = seen
        print(f"[driver] {name}: {seen['seconds']}s error={seen['error'] is not None}", flush=True)

    def refit(self, generation: Any, *, colocated: bool) -> dict[str, Any]:
        from nemo_rl.algorithms.grpo import refit_policy_generation  # type: ignore[import-not-found]

        started = time.monotonic()
        metrics = refit_policy_generation(self.policy, generation, colocated_inference=colocated)
        return {"metrics": metrics, "seconds": round(time.monotonic() - started, 2)}

    def generation(self, seen: dict[str, Any], *, async_engine: bool, **top: Any) -> Any:
        from nemo_rl.models.generation.vllm import VllmGeneration

        max_new = IN_FLIGHT_NEW if async_engine else MAX_NEW
        cfg = generation_config(
            self.a, self.tokenizer, async_engine=async_engine, max_new=max_new, **top
        )
        started = time.monotonic()
        generation = VllmGeneration(self.cluster, cfg)
        seen["start_seconds"] = round(time.monotonic() - started, 1)
        seen["device_uuids"] = generation.device_uuids
        seen["worker_class"] = ray.get(
            generation.worker_group.workers[0].__ray_call__.remote(lambda w: type(w).__module__)
        )
        generation.prepare_refit_info(self.policy.prepare_refit_info())
        return generation

    def generate(self, generation: Any, prompts: list[str], strings: Any = None, **kw: Any) -> Any:
        from nemo_rl.experience.rollouts import generate_responses  # type: ignore[import-not-found]

        data, batch, lengths = prompt_batch(self.tokenizer, prompts, strings)
        batch, _, _ = generate_responses(generation, data, batch, self.tokenizer, lengths, **kw)
        return data, batch

    # -- scenarios ----------------------------------------------------------------------
    def sync_refits_and_per_sample_stops(self, seen: dict[str, Any]) -> None:
        generation = self.generation(seen, async_engine=False, stop_strings_mode="per_sample")
        try:
            self.policy.train_to(self.a)
            seen["ipc_refits"] = [self.refit(generation, colocated=True)]
            data, batch = self.generate(generation, PROMPTS)
            seen["gap_after_ipc_a"] = logprob_gap(self.policy, data, batch)
            self.policy.train_to(self.b)
            seen["ipc_refits"].append(self.refit(generation, colocated=True))
            data, batch = self.generate(generation, PROMPTS)
            seen["gap_after_ipc_b"] = logprob_gap(self.policy, data, batch)
            self.policy.train_to(self.a)
            seen["gap_b_engine_vs_a_trainer"] = logprob_gap(self.policy, data, batch)
            seen["policy_calls"] = list(self.policy.calls)

            ip, port = self.cluster.get_master_address_and_port()
            ray.get(
                self.policy.init_collective(ip, port, 2, train_world_size=1)
                + generation.init_collective(ip, port, 2, train_world_size=1)
            )
            seen["collective_refits"] = [self.refit(generation, colocated=False)]
            data, batch = self.generate(generation, PROMPTS)
            seen["gap_after_collective_a"] = logprob_gap(self.policy, data, batch)
            self.policy.train_to(self.b)
            seen["collective_refits"].append(self.refit(generation, colocated=False))
            data, batch = self.generate(generation, PROMPTS)
            seen["gap_after_collective_b"] = logprob_gap(self.policy, data, batch)
            seen["rows"] = len(generated(batch))
            self.policy.train_to(self.a)  # the stop strings on A, as the batch-union engine
            seen["collective_refits"].append(self.refit(generation, colocated=False))
            self.stops(generation, seen)
            self.texts(generation, seen)
        finally:
            generation.shutdown()

    def stops(self, generation: Any, seen: dict[str, Any]) -> None:
        _, batch = self.generate(generation, PROMPTS, greedy=True)
        tokens = [m["token_ids"].tolist() for m in generated(batch)]
        strings = pick_stop_strings(self.tokenizer, tokens)
        one_row = next(s for s in strings if s)
        _, batch = self.generate(generation, PROMPTS, strings, greedy=True)
        seen["stop_strings"] = strings
        seen["stop_lengths"] = [len(m["token_ids"]) for m in generated(batch)]
        seen["expected_per_sample"] = expected_lengths(self.tokenizer, tokens, strings)
        seen["expected_batch_union"] = expected_lengths(
            self.tokenizer, tokens, [one_row] * len(tokens)
        )
        seen["unstopped_tokens"] = tokens

    def texts(self, generation: Any, seen: dict[str, Any]) -> None:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        out = generation.generate_text(
            BatchedDataDict({"prompts": PROMPTS, "stop_strings": [None] * len(PROMPTS)}),
            greedy=True,
        )
        seen["texts"] = list(out["texts"])
        _, batch = self.generate(generation, PROMPTS, greedy=True)
        seen["texts_of_tokens"] = [m["content"] for m in generated(batch)]

    def sync_batch_union_stops(self, seen: dict[str, Any]) -> None:
        generation = self.generation(seen, async_engine=False, stop_strings_mode="batch_union")
        try:
            self.policy.train_to(self.a)
            seen["ipc_refits"] = [self.refit(generation, colocated=True)]
            self.stops(generation, seen)
            self.texts(generation, seen)
        finally:
            generation.shutdown()

    def async_in_flight_refit(self, seen: dict[str, Any]) -> None:
        generation = self.generation(seen, async_engine=True)
        try:
            self.policy.train_to(self.a)
            seen["ipc_refits"] = [self.refit(generation, colocated=True)]
            data, batch = asyncio.run(self.generate_async(generation, PROMPTS))
            seen["gap_after_ipc_a"] = logprob_gap(self.policy, data, batch)
            self.policy.train_to(self.b)
            asyncio.run(self.in_flight(generation, seen))
            data, batch = asyncio.run(self.generate_async(generation, PROMPTS))
            seen["gap_after_in_flight_b"] = logprob_gap(self.policy, data, batch)
            self.async_stops(generation, seen)
        finally:
            generation.shutdown()

    async def generate_async(
        self, generation: Any, prompts: list[str], strings: Any = None, **kw: Any
    ) -> Any:
        """One ``generate_responses_async`` per sample, as async rollouts call it."""
        from nemo_rl.experience.rollouts import generate_responses_async

        async def one(i: int) -> Any:
            data, batch, lengths = prompt_batch(
                self.tokenizer, [prompts[i]], None if strings is None else [strings[i]]
            )
            batch, _, _ = await generate_responses_async(
                generation, data, batch, self.tokenizer, lengths, **kw
            )
            return data, batch

        rows = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        data, batch, _ = prompt_batch(self.tokenizer, prompts)
        batch["message_log"] = [b["message_log"][0] for _, b in rows]
        return data, batch

    async def in_flight(self, generation: Any, seen: dict[str, Any]) -> None:
        from nemo_rl.experience.rollouts import generate_responses_async

        times: list[tuple[float, float, list[int]]] = []

        async def one(i: int) -> None:
            data, batch, lengths = prompt_batch(self.tokenizer, [PROMPTS[i % len(PROMPTS)]])
            started = time.monotonic()
            batch, _, _ = await generate_responses_async(
                generation, data, batch, self.tokenizer, lengths
            )
            times.append((started, time.monotonic(), generated(batch)[0]["token_ids"].tolist()))

        tasks = [asyncio.create_task(one(i)) for i in range(IN_FLIGHT_ROWS)]
        await asyncio.sleep(IN_FLIGHT_AFTER_S)
        refit_started = time.monotonic()
        refit = await asyncio.to_thread(self.refit, generation, colocated=True)
        refit_ended = time.monotonic()
        await asyncio.gather(*tasks)
        seen["in_flight_refit"] = refit
        seen["in_flight_rows_sent"] = IN_FLIGHT_ROWS
        seen["in_flight_rows_back"] = len(times)
        seen["in_flight_tokens"] = [tokens for _, _, tokens in times]
        seen["stop_token_ids"] = list(generation.cfg["stop_token_ids"])
        seen["max_new_tokens"] = generation.cfg["max_new_tokens"]
        seen["in_flight_spanning"] = sum(s < refit_started and e > refit_ended for s, e, _ in times)

    def async_stops(self, generation: Any, seen: dict[str, Any]) -> None:
        _, batch = asyncio.run(self.generate_async(generation, PROMPTS, greedy=True))
        tokens = [m["token_ids"].tolist() for m in generated(batch)]
        strings = pick_stop_strings(self.tokenizer, tokens)
        _, batch = asyncio.run(self.generate_async(generation, PROMPTS, strings, greedy=True))
        seen["stop_strings"] = strings
        seen["stop_lengths"] = [len(m["token_ids"]) for m in generated(batch)]
        seen["expected_per_sample"] = expected_lengths(self.tokenizer, tokens, strings)


def main() -> None:
    model_a, model_b, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    ray.init(num_cpus=2, include_dashboard=False)
    switch_to_genworker()
    run = Run(model_a, model_b)
    run.report["device_id"] = cpu_device_id()
    run.report["python"] = sys.version.split()[0]
    try:
        run.scenario("sync", run.sync_refits_and_per_sample_stops)
        run.scenario("sync_batch_union", run.sync_batch_union_stops)
        run.scenario("async", run.async_in_flight_refit)
    finally:
        run.report["stubs_loaded"] = sorted(
            name for name, m in sys.modules.items() if type(m).__name__ == "_StubModule"
        )
        out.write_text(json.dumps(run.report, default=str))
        run.policy.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
