"""The engine suite that runs on CPU, now on CUDA, plus the worker's contract on a GPU.

The CPU suite's device-independent tests (``tests/shell/test_vllm_engine.py``: the adapter
against raw ``vllm.LLM``, finish reasons, text, metrics, bad requests, RPC) are imported
and run here against the session worker's CUDA engine: ``conftest.py`` binds their fixtures
``cpu_engine`` and ``cpu_llm`` (the CPU suite's names) to that engine.
"""

from __future__ import annotations

import math

import torch
from gpu.gpu_fixtures import (
    GPU_MARKS,
    MAX_MODEL_LEN,
    MAX_NEW_TOKENS,
    PROMPTS,
    GpuSession,
    batch,
    generated,
    greedy,
)
from shell.test_sampled_logprobs import (
    test_a_marked_batch_keeps_no_object_per_token,
    test_marked_requests_hold_what_vllms_flat_logprobs_hold,
    test_only_an_empty_no_tokenizer_detokenizer_gets_an_id_array,
    test_the_engine_keeps_the_hook,
    test_the_workers_params_are_marked_unless_the_row_needs_text,
)
from shell.test_vllm_engine import (  # noqa: F401 - stops: a fixture the tests take
    stops,
    test_bad_request_is_bad_batch_and_engine_keeps_serving,
    test_collective_rpc_answers_from_every_worker,
    test_collective_rpc_expiry_is_engine_dead,
    test_device_ids_name_the_device,
    test_finish_reasons,
    test_generate_text_matches_raw_vllm,
    test_generate_text_refuses_specs_that_do_not_detokenize,
    test_greedy_matches_raw_vllm,
    test_metrics_count_a_batch_tokens,
    test_only_rows_with_stop_strings_are_detokenized,
    test_seeded_sampling_matches_raw_vllm,
    test_the_collector_is_off_inside_llm_generate_and_on_after,
    test_the_collector_state_is_restored_when_generate_raises,
)

from genworker.shell.vllm_engine import VllmEngine

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

__all__ = [
    "test_a_marked_batch_keeps_no_object_per_token",
    "test_bad_request_is_bad_batch_and_engine_keeps_serving",
    "test_collective_rpc_answers_from_every_worker",
    "test_collective_rpc_expiry_is_engine_dead",
    "test_device_ids_name_the_device",
    "test_finish_reasons",
    "test_generate_text_matches_raw_vllm",
    "test_generate_text_refuses_specs_that_do_not_detokenize",
    "test_greedy_matches_raw_vllm",
    "test_marked_requests_hold_what_vllms_flat_logprobs_hold",
    "test_metrics_count_a_batch_tokens",
    "test_only_an_empty_no_tokenizer_detokenizer_gets_an_id_array",
    "test_only_rows_with_stop_strings_are_detokenized",
    "test_seeded_sampling_matches_raw_vllm",
    "test_the_collector_is_off_inside_llm_generate_and_on_after",
    "test_the_collector_state_is_restored_when_generate_raises",
    "test_the_engine_keeps_the_hook",
    "test_the_workers_params_are_marked_unless_the_row_needs_text",
]


def test_capabilities_describe_the_cuda_engine(cpu_engine: VllmEngine) -> None:
    caps = cpu_engine.capabilities
    assert caps.device == "cuda"
    assert caps.sleep_mode is True
    assert caps.vocab_size == 512
    assert caps.max_model_len == MAX_MODEL_LEN
    assert caps.flat_logprobs is True


def test_device_ids_name_this_gpu(gpu_session: GpuSession) -> None:
    (device,) = gpu_session.worker.report_device_id()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    assert uuid in device


def test_generate_returns_the_output_contract_on_cuda(gpu_session: GpuSession) -> None:
    worker, pad = gpu_session.worker, gpu_session.checkpoints.pad
    data = batch(PROMPTS, pad)
    out = worker.generate(data)
    lengths, gen = data["input_lengths"], out["generation_lengths"]
    assert out["output_ids"].shape[0] == len(PROMPTS)
    assert bool(((gen >= 1) & (gen <= MAX_NEW_TOKENS)).all())
    assert out["unpadded_sequence_lengths"].tolist() == (lengths + gen).tolist()
    for i, prompt in enumerate(PROMPTS):
        row = out["output_ids"][i]
        end = len(prompt) + int(gen[i])
        assert row[: len(prompt)].tolist() == list(prompt)
        assert bool((row[end:] == pad).all())
        logprobs = out["logprobs"][i, len(prompt) : end]
        assert all(math.isfinite(x) and x <= 0.0 for x in logprobs.tolist())
    tokens = generated(out, data)
    assert all(0 <= t < 512 for row in tokens for t in row)


def test_greedy_generation_is_reproducible(gpu_session: GpuSession) -> None:
    worker, pad = gpu_session.worker, gpu_session.checkpoints.pad
    assert greedy(worker, pad) == greedy(worker, pad) == gpu_session.baseline_a
