"""The handle types of the sleep-mode wake (genworker.core.cumem): vLLM's choice less a
refused fabric attempt."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from genworker.core.cumem import FABRIC, POSIX_FD, handle_types


@given(st.booleans(), st.booleans())
def test_the_handle_types_are_vllms_less_a_refused_fabric_attempt(
    supported: bool, refused: bool
) -> None:
    kinds = handle_types(supported, refused)
    assert kinds  # something is always asked for
    assert kinds[-1] != FABRIC  # the last resort is never the one a driver may refuse
    assert (FABRIC in kinds) == (supported and not refused)
    if not supported:
        assert kinds == (0,)  # vLLM asks for no shareable handle then
    else:
        assert kinds[-1] == POSIX_FD  # vLLM's fallback when the fabric handle is refused
