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


#: The completeness alarm each of vLLM's two loader loggers emits, by logger name.
_ALARMS = {INPLACE_LOGGER: NOT_LOADED, LAYERWISE_LOGGER: FAILED_TO_LOAD}


@contextlib.contextmanager
def refit_loader_alarms(direct: Collection[str], modules: Mapping[str, object]) -> Iterator[None]:
    """Around one refit's loader call: ``direct`` are the parameter names the refit wrote
    straight into parameter memory, ``modules`` the model's modules by name (the class of
    each directly written module, and of each module without a parameter of its own,
    explains one "Failed to load weights")."""
    held: list[logging.LogRecord] = []  # in emission order

    def hold(record: logging.LogRecord) -> bool:
        """Keep a completeness record back (a filter sees only its own logger's records, so
        ``record.name`` is the one)."""
        if record.msg == _ALARMS.get(record.name):
            held.append(record)
            return False
        return True

    for name in _ALARMS:
        logging.getLogger(name).addFilter(hold)
    failed = True
    try:
        yield
        failed = False
    finally:
        for name in _ALARMS:
            logging.getLogger(name).removeFilter(hold)
        for record in held if failed else _unexplained(held, direct, modules):
            logging.getLogger(record.name).handle(record)


def _unexplained(
    held: list[logging.LogRecord], direct: Collection[str], modules: Mapping[str, object]
) -> list[logging.LogRecord]:
    """The held records the direct routes do not explain (``core.loader_alarms``), a "not
    loaded" one narrowed to the names no route wrote."""
    verdicts = explain_alarms(
        [Alarm(record.msg == NOT_LOADED, _first_arg(record)) for record in held],
        set(direct),
        {name: type(module).__name__ for name, module in modules.items()},
        [type(m).__name__ for m in modules.values() if _holds_no_parameter(m)],
    )
    for record, verdict in zip(held, verdicts, strict=True):
        if verdict.rest is not None:
            record.args = (set(verdict.rest),)
    return [record for record, verdict in zip(held, verdicts, strict=True) if not verdict.explained]


def _first_arg(record: logging.LogRecord) -> object:
    return record.args[0] if isinstance(record.args, tuple) and record.args else None


def _holds_no_parameter(module: object) -> bool:
    own = getattr(module, "parameters", None)
    return callable(own) and next(iter(own(recurse=False)), None) is None
