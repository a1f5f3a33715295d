"""``EngineTarget``'s write: a verified tensor written into parameter memory is compared
with those bits where the parameter lives, and a write that did not land as those bits
is refused naming the tensor (no engine: the parameter is a plain tensor)."""

from __future__ import annotations

import pytest
import torch

from genworker.shell.errors import RefitError
from genworker.shell.refit.sparse import write_verified


def test_a_write_that_lands_is_taken_and_the_parameter_holds_the_bits() -> None:
    param = torch.zeros(4, 3, dtype=torch.bfloat16)
    verified = torch.randn(12).to(torch.bfloat16)
    write_verified(param, "w", verified)
    assert torch.equal(param.reshape(-1).view(torch.int16), verified.view(torch.int16))


def test_a_write_that_does_not_land_as_the_verified_bits_is_refused_naming_the_tensor() -> None:
    param = torch.zeros(4, 3, dtype=torch.float32)  # copy_ casts: other bits, other size
    with pytest.raises(RefitError, match=r"'w' in parameter memory differs from the verified"):
        write_verified(param, "w", torch.randn(12).to(torch.bfloat16))
