"""Which weight loader a refit takes: vLLM's layerwise reload wherever the model runner has
it, found by its signature on every runner genworker meets (vLLM 0.32's CPU runner names
``weights_iterator``; 0.25's V2 GPU runner forwards ``*args, **kwargs`` to the V1 runner's,
which names it). Run Z's fp8 engine on the H100 (vLLM 0.25) missed the second form and fell
back to ``model.load_weights``, which cannot load into fp8 parameters vLLM had replaced."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from genworker.shell.refit.engine import takes_weights_iterator


class _V1Runner:  # vLLM 0.32's CPU runner, 0.25's V1 GPU runner
    def reload_weights(
        self,
        weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None: ...


class _V2Runner:  # vLLM 0.25's V2 GPU runner (vllm/v1/worker/gpu/model_runner.py)
    def reload_weights(self, *args: object, **kwargs: object) -> None: ...


class _OldRunner:  # a runner that reloads from disk only
    def reload_weights(self, weights_path: str | None = None) -> None: ...


def test_the_layerwise_reload_is_found_on_every_runner_that_takes_an_iterator() -> None:
    assert takes_weights_iterator(_V1Runner().reload_weights)
    assert takes_weights_iterator(_V2Runner().reload_weights)
    assert not takes_weights_iterator(_OldRunner().reload_weights)
