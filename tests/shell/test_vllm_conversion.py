"""Converting vLLM's request outputs into generations (no engine needed).

The typings stub only the attributes genworker reads; the constructors here come from
the installed vLLM, reached untyped."""

from __future__ import annotations

from typing import Any

import pytest
import vllm.logprobs
import vllm.outputs
from hypothesis import given
from hypothesis import strategies as st

from genworker.shell.errors import GenworkerError
from genworker.shell.vllm_engine import _generation, _generations

_vllm_logprobs: Any = vllm.logprobs
_vllm_outputs: Any = vllm.outputs


def _completion(tokens: list[int], logprobs: list[float], *, extra: bool = False) -> Any:
    flat = _vllm_logprobs.FlatLogprobs()
    logprob = _vllm_logprobs.Logprob
    for i, (token, value) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = {token: logprob(logprob=value, rank=1, decoded_token=None)}
        if extra and i == 0:  # a top-1 alternative: two entries at this position
            entry[token + 1] = logprob(logprob=value - 1.0, rank=2, decoded_token=None)
        flat.append(entry)
    return _vllm_outputs.CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=flat,
        finish_reason="length",
    )


_rows = st.lists(
    st.lists(
        st.tuples(st.integers(0, 1000), st.floats(-20.0, 0.0, width=32)), min_size=0, max_size=6
    ),
    min_size=1,
    max_size=5,
)


@given(_rows, st.booleans())
def test_bulk_conversion_equals_the_row_by_row_one(
    rows: list[list[tuple[int, float]]], extra: bool
) -> None:
    outs = [
        _completion([t for t, _ in row], [v for _, v in row], extra=extra and bool(row))
        for row in rows
    ]
    assert _generations(outs) == [_generation(i, o) for i, o in enumerate(outs)]


def test_conversion_names_a_row_whose_logprobs_are_for_other_tokens() -> None:
    good = _completion([5, 6], [-1.0, -2.0])
    bad = _completion([7, 8], [-1.0, -2.0])
    bad.logprobs.token_ids[1] = 9
    with pytest.raises(GenworkerError, match="row 1"):
        _generations([good, bad])


def test_a_shifted_flat_layout_is_not_taken_for_one_entry_per_position() -> None:
    # Position 0 holds nothing and position 1 holds two entries whose ids happen to
    # spell the generated tokens: as many entries as tokens, yet not one per position.
    flat = _vllm_logprobs.FlatLogprobs()
    logprob = _vllm_logprobs.Logprob
    flat.append(None)
    flat.append(
        {
            5: logprob(logprob=-1.0, rank=1, decoded_token=None),
            6: logprob(logprob=-2.0, rank=2, decoded_token=None),
        }
    )
    out = _vllm_outputs.CompletionOutput(
        index=0,
        text="",
        token_ids=[5, 6],
        cumulative_logprob=None,
        logprobs=flat,
        finish_reason="length",
    )
    with pytest.raises(GenworkerError, match="row 0"):
        _generations([out])
