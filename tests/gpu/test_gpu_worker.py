"""The worker suite that runs on the CPU engine (``tests/shell/test_worker_engine.py``), on CUDA.

Its device-independent tests (the worker against raw ``vllm.LLM``, the output contract on
real output, per-sample stop strings, bad inputs, the context cap, counters, text) run
here against the session worker's CUDA engine, wrapped by a second worker through
``ExistingEngine`` as there; ``conftest.py`` binds the CPU suite's fixtures ``cpu_engine``
and ``cpu_llm`` to that engine.
"""

from __future__ import annotations

from gpu.gpu_fixtures import GPU_MARKS
from shell.test_worker_engine import (
    test_bad_inputs_are_typed_and_the_engine_serves_the_next_batch,
    test_context_cap_keeps_rows_inside_max_model_len,
    test_contract_on_real_output,
    test_counters_show_the_batch_token_totals,
    test_empty_batch_gives_empty_tensors,
    test_generate_text_returns_texts,
    test_per_sample_stop_strings_stop_only_their_own_row,
    test_the_nemo_rl_worker_over_the_real_engine,
    test_tokenize_gives_the_ids_vllm_makes_of_a_text_prompt,
    worker,
)
from shell.test_worker_engine import (
    test_greedy_matches_raw_vllm as test_worker_greedy_matches_raw_vllm,
)
from shell.test_worker_engine import (
    test_seeded_sampling_matches_raw_vllm as test_worker_seeded_sampling_matches_raw_vllm,
)

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
    "test_the_nemo_rl_worker_over_the_real_engine",
    "test_tokenize_gives_the_ids_vllm_makes_of_a_text_prompt",
    "test_worker_greedy_matches_raw_vllm",
    "test_worker_seeded_sampling_matches_raw_vllm",
    "worker",
]
