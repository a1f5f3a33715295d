"""vLLM's completeness alarms during a refit that writes some weights itself: kept exact.

Theory of operation
-------------------
A refit puts part of the weights straight into parameter memory (the direct routes of
``core.refit_protocol.plan_routes``: whole unquantized modules) and hands the rest to
vLLM's loader in one ``reload_weights(weights_iterator=...)`` call. vLLM 0.32's loader
then judges completeness as if that call were a full checkpoint load:

* ``vllm/model_executor/model_loader/reload/inplace.py`` ``reload_weights`` warns
  ``"Following weights were not loaded from checkpoint: %s"`` with the set of parameter
  names (vLLM's names) the call did not load, on an unquantized model;
* ``vllm/model_executor/model_loader/reload/layerwise.py`` ``finalize_layerwise_reload``
  warns ``"%s: Failed to load weights"`` with the class name of every layer that had
  loadable weights and got none, and puts that layer's previous kernel tensors back.

For a refit both are true only for weights that no route wrote. :func:`refit_loader_alarms`
holds those two records back while the refit runs and, when it ends, lets through exactly
what the direct routes do not explain: the not-loaded names minus the names written
directly (one warning in vLLM's own words naming only the rest), and one "Failed to load
weights" per layer beyond the count of directly written modules of that class. A weight
that no route wrote is still reported, by name; a refit that raises gets every held record
back unchanged. Records are matched by logger name and message format, both checked
against the installed vLLM's source by the tests.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Mapping

__all__ = [
    "FAILED_TO_LOAD",
    "INPLACE_LOGGER",
    "LAYERWISE_LOGGER",
    "NOT_LOADED",
    "refit_loader_alarms",
]

INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
NOT_LOADED = "Following weights were not loaded from checkpoint: %s"
FAILED_TO_LOAD = "%s: Failed to load weights"


class _Hold(logging.Filter):
    """Keeps one logger's completeness records (in ``held``, shared, in emission order)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        held: list[tuple[logging.Logger, logging.LogRecord]],
    ) -> None:
        super().__init__()
        self.logger, self.message, self.held = logger, message, held

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.message:
            self.held.append((self.logger, record))
            return False
        return True


def _first_arg(record: logging.LogRecord) -> object:
    return record.args[0] if isinstance(record.args, tuple) and record.args else None


@contextlib.contextmanager
def refit_loader_alarms(direct: Collection[str], modules: Mapping[str, object]) -> Iterator[None]:
    """Around one refit's loader call: ``direct`` are the parameter names the refit wrote
    straight into parameter memory, ``modules`` the model's modules by name (the class of
    each directly written module, and of each module without a parameter of its own,
    explains one "Failed to load weights")."""
    held: list[tuple[logging.Logger, logging.LogRecord]] = []
    holds = [
        _Hold(logging.getLogger(INPLACE_LOGGER), NOT_LOADED, held),
        _Hold(logging.getLogger(LAYERWISE_LOGGER), FAILED_TO_LOAD, held),
    ]
    for hold in holds:
        hold.logger.addFilter(hold)
    failed = True
    try:
        yield
        failed = False
    finally:
        for hold in holds:
            hold.logger.removeFilter(hold)
        explained = _explained(set(direct), modules)
        for logger, record in held:
            if failed or not explained(record):
                logger.handle(record)


def _holds_no_parameter(module: object) -> bool:
    own = getattr(module, "parameters", None)
    return callable(own) and next(iter(own(recurse=False)), None) is None


def _explained(
    written: set[str], modules: Mapping[str, object]
) -> Callable[[logging.LogRecord], bool]:
    """Whether a held record is wholly explained by the direct routes; a not-loaded record
    that is only partly explained is narrowed to the rest (and let out)."""
    budget = collections.Counter(
        type(modules[m]).__name__ for m in {n.rpartition(".")[0] for n in written} if m in modules
    )
    # A module with no parameter of its own (RotaryEmbedding: a cos_sin_cache buffer) takes
    # no weight from any refit or checkpoint; vLLM's reload reports it unloaded every time.
    budget.update(type(m).__name__ for m in modules.values() if _holds_no_parameter(m))

    def explained(record: logging.LogRecord) -> bool:
        arg = _first_arg(record)
        if record.msg == NOT_LOADED:
            if not isinstance(arg, Collection) or isinstance(arg, str):
                return False  # not vLLM's shape: nothing to explain away
            rest = {str(n) for n in arg} - written
            if rest:
                record.args = (rest,)
            return not rest
        if isinstance(arg, str) and budget[arg] > 0:
            budget[arg] -= 1
            return True
        return False

    return explained
