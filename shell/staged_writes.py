"""The model runner's staged GPU writes, read and dropped on each vLLM worker.

Theory of operation
-------------------
vLLM's V2 GPU model runner (``vllm/v1/worker/gpu/``, the default for a non-MoE model on
CUDA in 0.25, there in 0.32 too; the CPU engine runs the V1 runner) records a new
request's per-slot state as *staged writes*: ``GPUModelRunner.add_requests``
(vllm/v1/worker/gpu/model_runner.py:766-811, 0.25) claims a slot
(``RequestState.add_request``, vllm/v1/worker/gpu/states.py:87-113: ``free_indices.pop()``)
and stages its ``total_len``, ``all_token_ids`` and ``num_computed_tokens`` and its block
table row (block_table.py:107-120) in ``StagedWriteTensor``\\ s; the writes reach the GPU
only at the end of ``add_requests`` and in ``execute_model`` (model_runner.py:1129).

When one request's add raises on the way (a seed that numpy's int64 cannot hold:
``self.seeds.np[req_idx] = seed``, vllm/v1/worker/gpu/sample/states.py:54), the writes
staged for it and for the requests added before it in that step stay queued: nothing
applies or clears them. Aborting the requests frees their slots on the next step
(``_remove_request``, model_runner.py:729-743; states.py:122-128) but leaves the writes.
Slots are reused last-freed first, so the next batch's first request takes the slot of
the request that failed, and one ``StagedWriteTensor.apply_write``
(vllm/v1/worker/gpu/buffer_utils.py:174-201: one Triton program per staged write, all in
parallel) stores the dead request's values and the new one's into the same row: which
lands is a race. The prefill reads its tokens from that row (``all_token_ids``,
input_batch.py:185-220). On the H200 runner (issue 18) row 0 ``[5, 17, 99, 240, 7]`` was
prefilled as ``[5, 6, 99, 240, 7]`` (the dead request was ``[5, 6]``): its greedy tokens
are exactly those of that prompt (the tiny model's first token is the same for both).

So after aborting the requests of a step that raised, the worker drops every write the
runner still has staged (:func:`drop_staged_writes`, through ``LLM.collective_rpc``): they
belong to requests that never ran and are all aborted, and each later add writes every
field of its slot again. Dropping touches no GPU buffer (applying them would rotate vLLM's
round-robin host buffers under a step still in flight). Left queued: a penalised
request's bin count (``PenaltiesState._new_penalties_reqs``, sample/penalties.py:46-76);
it zeroes the slot's row and recounts the next occupant's tokens, which doubles only the
output counts of a penalised request resumed into that slot. Both functions take the vLLM
worker (``collective_rpc`` passes it first) and walk only the V2 runner's own objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

__all__ = ["drop_staged_writes", "pending_staged_writes"]

# The V2 runner's package; the V1 runners are vllm.v1.worker.gpu_model_runner and
# vllm.v1.worker.cpu_model_runner, outside it.
_V2_PACKAGE = "vllm.v1.worker.gpu."


def pending_staged_writes(worker: object) -> int:
    """How many writes this worker's model runner has staged and not applied (0 for a
    runner without staged writes)."""
    return sum(len(t._staged_write_indices) for t in _staged_tensors(worker))


def drop_staged_writes(worker: object) -> int:
    """Drop every write this worker's model runner has staged; how many there were."""
    tensors = _staged_tensors(worker)
    dropped = sum(len(t._staged_write_indices) for t in tensors)
    for t in tensors:
        t.clear_staged_writes()
    return dropped


def _staged_tensors(worker: object) -> list[StagedWriteTensor]:
    runner = getattr(worker, "model_runner", None)
    if not type(runner).__module__.startswith(_V2_PACKAGE):
        return []
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    found: list[StagedWriteTensor] = []
    seen: set[int] = set()
    todo: list[object] = [runner]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, StagedWriteTensor):
            found.append(obj)
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif type(obj).__module__.startswith(_V2_PACKAGE):
            todo.extend(getattr(obj, "__dict__", {}).values())
    return found
