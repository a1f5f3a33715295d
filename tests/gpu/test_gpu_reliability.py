"""The reliability suite of the CPU engine (``tests/shell/test_worker_reliability.py``), on CUDA.

Its device-independent tests run against the session worker's CUDA engine (vLLM 0.25 on
the runner), through ``conftest.py``'s binding of ``cpu_engine`` and ``cpu_llm``: seeds
bounded up front; the seed vLLM raises on inside its step, let through, aborts the batch
(``LLMEngine.abort_request(ids, internal=True)`` on this vLLM too) and the worker serves
on; a step that raised while adding its requests leaves no write staged in the model
runner after the recovery (issue 18: vLLM's V2 runner, the default here, keeps them); an
engine that cannot abort is declared dead; concurrent generates get their serial results;
dtypes that cannot hold the vocabulary, exotic tensors and non-mapping data are typed
errors. The refit tests there send the CPU suite's tiny model and stay on CPU.
"""

from __future__ import annotations

from gpu.gpu_fixtures import GPU_MARKS
from shell.test_worker_reliability import (
    baseline,
    test_a_dtype_that_cannot_hold_the_vocabulary_is_refused_naming_it,
    test_a_dtype_that_holds_the_vocabulary_gives_the_same_tokens_in_that_dtype,
    test_a_request_vllm_rejects_at_admission_stays_a_bad_batch,
    test_a_seed_out_of_the_generator_range_is_refused_naming_the_row,
    test_a_step_that_raised_while_adding_its_requests_leaves_no_staged_writes,
    test_an_engine_that_cannot_abort_is_declared_dead,
    test_concurrent_generates_get_their_serial_results,
    test_exotic_tensors_are_typed_errors_naming_the_input,
    test_non_mapping_data_is_a_typed_error,
    test_the_largest_seed_samples,
    test_the_seed_that_hung_the_engine_now_aborts_its_batch_and_the_worker_serves_on,
    watched,
)

pytest_plugins = ["gpu.gpu_fixtures"]
pytestmark = GPU_MARKS

__all__ = [
    "baseline",
    "test_a_dtype_that_cannot_hold_the_vocabulary_is_refused_naming_it",
    "test_a_dtype_that_holds_the_vocabulary_gives_the_same_tokens_in_that_dtype",
    "test_a_request_vllm_rejects_at_admission_stays_a_bad_batch",
    "test_a_seed_out_of_the_generator_range_is_refused_naming_the_row",
    "test_a_step_that_raised_while_adding_its_requests_leaves_no_staged_writes",
    "test_an_engine_that_cannot_abort_is_declared_dead",
    "test_concurrent_generates_get_their_serial_results",
    "test_exotic_tensors_are_typed_errors_naming_the_input",
    "test_non_mapping_data_is_a_typed_error",
    "test_the_largest_seed_samples",
    "test_the_seed_that_hung_the_engine_now_aborts_its_batch_and_the_worker_serves_on",
    "watched",
]
