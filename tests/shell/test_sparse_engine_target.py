"""``EngineTarget.apply``: a verified tensor written into parameter memory is compared
with those bits where the parameter lives, and a write that did not land as those bits
is refused naming the tensor (no engine: the target's sink is a stand-in that hands out
the parameter tensors)."""

from __future__ import annotations

import attrs
import pytest
import torch

from genworker.core import refit_protocol as p
from genworker.shell.errors import RefitError
from genworker.shell.refit.engine import EngineContext
from genworker.shell.refit.sparse import EngineTarget


@attrs.define
class Sink:
    params: dict[str, torch.Tensor]

    def target(self, name: str) -> torch.Tensor:
        return self.params[name]


def target_over(params: dict[str, torch.Tensor]) -> EngineTarget:
    target = EngineTarget(EngineContext(object()), lambda step: None)
    target._sink = Sink(params)  # type: ignore[assignment]
    target._routes = p.Routes(direct=frozenset(params))
    return target


def test_a_write_that_lands_is_taken_and_the_parameter_holds_the_bits() -> None:
    param = torch.zeros(4, 3, dtype=torch.bfloat16)
    target = target_over({"w": param})
    verified = torch.randn(12).to(torch.bfloat16)
    target.apply("w", verified)
    assert torch.equal(param.reshape(-1).view(torch.int16), verified.view(torch.int16))
    assert target._direct == ["w"]


def test_a_write_that_does_not_land_as_the_verified_bits_is_refused_naming_the_tensor() -> None:
    param = torch.zeros(4, 3, dtype=torch.float32)  # copy_ casts: other bits, other size
    target = target_over({"w": param})
    with pytest.raises(RefitError, match=r"'w' in parameter memory differs from the verified"):
        target.apply("w", torch.randn(12).to(torch.bfloat16))
    assert target._direct == []
