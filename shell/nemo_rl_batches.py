"""Whether this process can read the batches NeMo-RL sends: its modules, imported up front.

Theory of operation
-------------------
NeMo-RL's ``VllmGeneration`` hands its workers ``BatchedDataDict[GenerationDatumSpec](...)``
(``nemo_rl/models/generation/vllm/vllm_generation.py`` at NeMo-RL 7ea279ab). Calling a
subscripted generic sets the instance's ``__orig_class__`` to the alias
``BatchedDataDict[GenerationDatumSpec]``; pickle reduces that alias to
``operator.getitem(BatchedDataDict, GenerationDatumSpec)``, both classes by reference. Ray
pickles a task's arguments in the caller and unpickles them in the actor before the method
runs (``ray/_private/serialization.py``: the arguments are deserialized by the worker that
executes the task), so the actor imports ``nemo_rl.distributed.batched_data_dict`` and
``nemo_rl.models.generation.interfaces`` (and with it the package
``nemo_rl.models.generation``, whose ``__init__`` runs first) before genworker's code sees
anything. Where that import fails (NeMo-RL main asserts a transformers older than vLLM 0.32
needs) the task fails in deserialization, and NeMo-RL's async rollout keeps the sample with
0 turns and reward 0: a sample lost with no error that reaches the trainer.

genworker cannot read the argument itself, so the drop-ins import those modules when they
are built (:func:`require_batch_modules`): an import that fails is a
:class:`NemoRlEnvironmentError` there, naming the module, its error and what to change, on
the first call NeMo-RL makes (the actor's construction), which NeMo-RL does not swallow.
A process without NeMo-RL at all (genworker's own tests, a driver that sends plain dicts)
gets one warning instead: NeMo-RL's pickled batches could not be read there either, and the
warning says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Final

from genworker.shell.errors import GenworkerError

__all__ = ["NEMO_RL_BATCH_MODULES", "NemoRlEnvironmentError", "require_batch_modules"]

log = logging.getLogger(__name__)

#: what unpickling ``BatchedDataDict[GenerationDatumSpec](...)`` imports, in import order
NEMO_RL_BATCH_MODULES: Final = (
    "nemo_rl.distributed.batched_data_dict",
    "nemo_rl.models.generation.interfaces",
)


class NemoRlEnvironmentError(GenworkerError, ImportError):
    """This process cannot import a NeMo-RL module that NeMo-RL's batches unpickle through."""


def require_batch_modules(
    *,
    find_spec: Callable[[str], object | None] = importlib.util.find_spec,
    import_module: Callable[[str], object] = importlib.import_module,
) -> bool:
    """Import :data:`NEMO_RL_BATCH_MODULES`: True when they import, False (with one warning)
    when NeMo-RL is not installed here; :class:`NemoRlEnvironmentError` when it is and one
    of them fails to import. ``find_spec`` / ``import_module`` are importlib's (tests)."""
    try:
        installed = find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        log.warning(
            "NeMo-RL (the nemo_rl package) is not importable in this process: batches NeMo-RL "
            "sends as BatchedDataDict cannot be unpickled here (Ray would fail the call before "
            "genworker sees it); only plain mappings can be read"
        )
        return False
    for module in NEMO_RL_BATCH_MODULES:
        try:
            import_module(module)
        except Exception as e:  # any import-time failure: an assert, a missing dependency
            raise NemoRlEnvironmentError(
                f"this worker's Python environment cannot import {module} "
                f"({type(e).__name__}: {e}); NeMo-RL's batches "
                "(BatchedDataDict[GenerationDatumSpec]) unpickle through it, so every "
                "generate call NeMo-RL makes here would fail before genworker sees it; "
                "install what that import needs into this environment (or a NeMo-RL whose "
                "requirements it meets)"
            ) from e
    return True
