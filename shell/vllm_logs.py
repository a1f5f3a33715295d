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
what the direct routes do not explain (``core.loader_alarms`` decides): a weight that no
route wrote is still reported, by name, in vLLM's own words; a refit that raises gets every
held record back unchanged. Records are matched by logger name and message format, both
checked against the installed vLLM's source by the tests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Mapping

from genworker.core.loader_alarms import Alarm, explain_alarms

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
        for logger, record in held if failed else _unexplained(held, direct, modules):
            logger.handle(record)


def _unexplained(
    held: list[tuple[logging.Logger, logging.LogRecord]],
    direct: Collection[str],
    modules: Mapping[str, object],
) -> list[tuple[logging.Logger, logging.LogRecord]]:
    """The held records the direct routes do not explain (``core.loader_alarms``), a "not
    loaded" one narrowed to the names no route wrote."""
    verdicts = explain_alarms(
        [Alarm(record.msg == NOT_LOADED, _first_arg(record)) for _, record in held],
        set(direct),
        {name: type(module).__name__ for name, module in modules.items()},
        [type(m).__name__ for m in modules.values() if _holds_no_parameter(m)],
    )
    for (_, record), verdict in zip(held, verdicts, strict=True):
        if verdict.rest is not None:
            record.args = (set(verdict.rest),)
    return [pair for pair, verdict in zip(held, verdicts, strict=True) if not verdict.explained]


def _first_arg(record: logging.LogRecord) -> object:
    return record.args[0] if isinstance(record.args, tuple) and record.args else None


def _holds_no_parameter(module: object) -> bool:
    own = getattr(module, "parameters", None)
    return callable(own) and next(iter(own(recurse=False)), None) is None
