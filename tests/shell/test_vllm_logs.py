"""vLLM's completeness alarms around a refit: the direct routes explain them away, nothing else.

The records are emitted through the installed vLLM's own logger objects with the format
strings its loader uses (checked against its source below), as ``reload_weights`` and
``finalize_layerwise_reload`` emit them.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from vllm.model_executor.model_loader.reload import inplace, layerwise

from genworker.shell.vllm_logs import (
    FAILED_TO_LOAD,
    INPLACE_LOGGER,
    LAYERWISE_LOGGER,
    NOT_LOADED,
    refit_loader_alarms,
)


class _Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def seen() -> Iterator[list[logging.LogRecord]]:
    """Every record vLLM's two loader loggers let out (they do not propagate)."""
    catch = _Catch()
    loggers = [inplace.logger, layerwise.logger]
    for logger in loggers:
        logger.addHandler(catch)
    yield catch.records
    for logger in loggers:
        logger.removeHandler(catch)


MODULES = {
    "layers.0.mlp": nn.Linear(2, 2),
    "layers.1.mlp": nn.Linear(2, 2),
    "layers.0.norm": nn.LayerNorm(2),
}


def test_the_formats_and_loggers_are_the_installed_vllms() -> None:
    assert inplace.logger.name == INPLACE_LOGGER
    assert layerwise.logger.name == LAYERWISE_LOGGER
    assert f'"{NOT_LOADED}"' in inspect.getsource(inplace.reload_weights)
    assert f'"{FAILED_TO_LOAD}"' in inspect.getsource(layerwise)


def test_what_the_direct_routes_wrote_is_no_alarm(seen: list[logging.LogRecord]) -> None:
    direct = ["layers.0.mlp.weight", "layers.0.mlp.bias"]
    with refit_loader_alarms(direct, MODULES):
        layerwise.logger.warning(FAILED_TO_LOAD, "Linear")
        inplace.logger.warning(NOT_LOADED, set(direct))
    assert seen == []


def test_a_weight_no_route_wrote_is_still_named(seen: list[logging.LogRecord]) -> None:
    direct = ["layers.0.mlp.weight", "layers.0.mlp.bias"]
    with refit_loader_alarms(direct, MODULES):
        layerwise.logger.warning(FAILED_TO_LOAD, "Linear")
        layerwise.logger.warning(FAILED_TO_LOAD, "Linear")  # layers.1.mlp: nobody wrote it
        layerwise.logger.warning(FAILED_TO_LOAD, "LayerNorm")
        inplace.logger.warning(NOT_LOADED, {*direct, "layers.1.mlp.weight", "layers.0.norm.weight"})
    assert [r.getMessage() for r in seen if r.name == LAYERWISE_LOGGER] == [
        "Linear: Failed to load weights",
        "LayerNorm: Failed to load weights",
    ]
    (missing,) = [r for r in seen if r.name == INPLACE_LOGGER]
    assert missing.args == ({"layers.1.mlp.weight", "layers.0.norm.weight"},)
    assert missing.levelno == logging.WARNING


class _Rotary(nn.Module):  # vLLM's RotaryEmbedding: a cos/sin cache, no parameter
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2))


def test_a_module_without_parameters_is_no_missing_weight(seen: list[logging.LogRecord]) -> None:
    """vLLM's reload reports a buffer-only layer unloaded on every partial load (seen for
    RotaryEmbedding on the tiny Llama's IPC refit): no refit can carry a weight for it.
    A layer that holds parameters is still reported."""
    modules = {**MODULES, "rotary": _Rotary()}
    with refit_loader_alarms([], modules):
        layerwise.logger.warning(FAILED_TO_LOAD, "_Rotary")
        layerwise.logger.warning(FAILED_TO_LOAD, "Linear")
    assert [r.getMessage() for r in seen] == ["Linear: Failed to load weights"]


def test_a_refit_that_raises_gets_every_record_back(seen: list[logging.LogRecord]) -> None:
    direct = ["layers.0.mlp.weight"]

    def refit() -> None:
        with refit_loader_alarms(direct, MODULES):
            layerwise.logger.warning(FAILED_TO_LOAD, "Linear")
            inplace.logger.warning(NOT_LOADED, set(direct))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        refit()
    assert [r.getMessage() for r in seen] == [
        "Linear: Failed to load weights",
        f"Following weights were not loaded from checkpoint: {set(direct)}",
    ]


def test_other_records_and_records_outside_a_refit_pass(seen: list[logging.LogRecord]) -> None:
    with refit_loader_alarms(["layers.0.mlp.weight"], MODULES):
        inplace.logger.warning("Reloading with `is_checkpoint_format=True` requires ...")
        layerwise.logger.warning("%s: Delayed processing", "Linear")
    inplace.logger.warning(NOT_LOADED, {"layers.0.mlp.weight"})
    layerwise.logger.warning(FAILED_TO_LOAD, "Linear")
    assert len(seen) == 4
    assert not inplace.logger.filters
    assert not layerwise.logger.filters


def test_records_not_in_vllms_shape_are_let_through(seen: list[logging.LogRecord]) -> None:
    with refit_loader_alarms(["layers.0.mlp.weight"], MODULES):
        inplace.logger.warning(NOT_LOADED, "layers.0.mlp.weight")
        layerwise.logger.warning(FAILED_TO_LOAD, 3)
        layerwise.logger.warning(FAILED_TO_LOAD, "Mystery")
    assert len(seen) == 3
