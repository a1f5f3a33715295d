"""The real-engine refit modules' fixtures, as a pytest plugin (``pytest_plugins =
["refit_engine_fixtures"]``): the saved weights A and B, B's greedy tokens from a fresh
engine, and an engine with the worker extension started on A. Module-scoped: each module
that loads the plugin starts and stops its own engines (mind the file order, tests/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from refit_helpers import Engine, Weights, greedy, start_engine, stop_engine

from genworker.demo.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Weights:
    b_dir = build_tiny_model(tmp_path_factory.mktemp("refit") / "tiny-llama-b", seed=1)
    return Weights(tiny_model_dir / "model.safetensors", b_dir / "model.safetensors", b_dir)


@pytest.fixture(scope="module")
def reference_b(weights: Weights) -> list[list[int]]:
    """Greedy tokens of a fresh engine started on the saved weights B."""
    llm = start_engine(weights.b_dir, extension=False)
    try:
        return greedy(llm)
    finally:
        stop_engine(llm)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, reference_b: list[list[int]]) -> Iterator[Engine]:
    llm = start_engine(tiny_model_dir, extension=True)
    try:
        yield Engine(llm, greedy(llm))
    finally:
        llm.collective_rpc("cleanup")
        stop_engine(llm)
