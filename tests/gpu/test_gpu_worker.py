"""The worker suite that runs on the CPU engine (``tests/shell/test_worker_engine.py``), on CUDA.

Its device-independent tests (the worker against raw ``vllm.LLM``, the output contract on
real output, per-sample stop strings, bad inputs, the context cap, counters, text) run
here against the session worker's CUDA engine, wrapped by a second worker through
``ExistingEngine`` as there. The CPU suite's fixture names ``cpu_engine`` and ``cpu_llm``
are bound to that engine (module-scoped: Hypothesis refuses function-scoped fixtures).
"""

from __future__ import annotations

import pytest
from gpu.gpu_fixtures import GPU_MARKS, GpuSession, session_engine
from shell.test_worker_engine import (
    test_bad_inputs_are_typed_and_the_engine_serves_the_next_batch,
    test_context_cap_keeps_rows_inside_max_model_len,
    test_contract_on_real_output,
    test_counters_show_the_batch_token_totals,
    test_empty_batch_gives_empty_tensors,
    test_generate_text_returns_texts,
    test_per_sample_stop_strings_stop_only_their_own_row,
    worker,
)
from shell.test_worker_engine import (
    test_greedy_matches_raw_vllm as test_worker_greedy_matches_raw_vllm,
)
from shell.test_worker_engine import (
    test_seeded_sampling_matches_raw_vllm as test_worker_seeded_sampling_matches_raw_vllm,
)
from vllm import LLM

from genworker.shell.vllm_engine import VllmEngine

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

__all__ = [
    "test_bad_inputs_are_typed_and_the_engine_serves_the_next_batch",
    "test_context_cap_keeps_rows_inside_max_model_len",
    "test_contract_on_real_output",
    "test_counters_show_the_batch_token_totals",
    "test_empty_batch_gives_empty_tensors",
    "test_generate_text_returns_texts",
    "test_per_sample_stop_strings_stop_only_their_own_row",
    "test_worker_greedy_matches_raw_vllm",
    "test_worker_seeded_sampling_matches_raw_vllm",
    "worker",
]


@pytest.fixture(scope="module")
def cpu_engine(gpu_session: GpuSession) -> VllmEngine:
    """The CPU suite's engine fixture, bound to the session worker's CUDA engine."""
    return session_engine(gpu_session)


@pytest.fixture(scope="module")
def cpu_llm(cpu_engine: VllmEngine) -> LLM:
    """The CPU suite's raw ``vllm.LLM`` fixture: the one the CUDA adapter wraps."""
    return cpu_engine.llm
