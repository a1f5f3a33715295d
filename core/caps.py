"""Per-request token caps: how many new tokens each prompt may ask vLLM for.

Theory of operation
-------------------
vLLM's offline ``LLM.generate`` stops a request at ``max_model_len`` by itself (finish reason
``length``), so with no capping the configured ``max_new_tokens`` is passed through unchanged.
Two rules lower it per request:

* **Context cap** (opt-in, NeMo-RL ``cap_max_tokens_to_context``): ask for at most the room
  left in the context, ``min(max_new_tokens, max_model_len - input_length)``. The OpenAI
  server rejects prompt + ``max_tokens`` > context instead of clamping (vllm#42474), and the
  cap makes ``max_tokens`` an honest per-row budget.
* **Speculative-decoding clamp** (always, when ``num_speculative_tokens`` k > 0): the drafter
  (Eagle3 in particular) writes k look-ahead slots plus the bonus token past the last accepted
  one, so generation must stop at least k + 1 tokens before ``max_model_len``, or it reads past
  the end of the context (a CUDA illegal memory access that poisons the process; NeMo-RL
  ``_spec_decode_max_tokens``). Cap: ``min(max_new_tokens, max_model_len - input_length -
  (k + 1))``.

Both reduce to ``min(max_new_tokens, max_model_len - reserve - input_length)`` with reserve 0
(context) or k + 1 (spec decode); the clamp is the tighter of the two, so it wins when both
apply. Deliberate fix vs NeMo-RL: where that leaves less than one token, NeMo-RL floors at 1
and steps past the context end; here the row is refused with a :class:`CapError` naming it.

The batch form is vectorised over a 1-D integer tensor or a sequence of ints and equals the
scalar form row by row, errors included. :func:`cap_rows` is the batch form that refuses
rows one by one: a row without room gets ``max_tokens`` 0 and is named in
``RowCaps.refused`` while the other rows keep their caps (NeMo-RL's async worker returns
such a row unchanged; the output contract allows a generation of length 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "MAX_INPUT_LENGTH",
    "MAX_SCALAR_ARGUMENT",
    "CapArgumentError",
    "CapError",
    "CapFailure",
    "RowCaps",
    "batch_max_tokens",
    "cap_rows",
    "context_cap",
    "no_room_error",
    "request_max_tokens",
    "reserved_tokens",
    "spec_decode_cap",
]

MAX_SCALAR_ARGUMENT = 2**60
"""Upper bound for ``max_model_len`` and ``num_speculative_tokens`` (keeps the vectorised
arithmetic inside int64 with room to spare; real values are many orders of magnitude lower)."""

MAX_INPUT_LENGTH = 2**63 - 1
"""Upper bound for an input length: the int64 range of a lengths tensor."""


@attrs.frozen
class CapError(CoreError):
    """Some rows leave no room to generate: ``input_length >= max_model_len - reserve``.

    ``rows`` and ``input_lengths`` are parallel (a scalar request is row 0); ``reserve`` is
    the number of slots held back before ``max_model_len`` (0, or k + 1 for speculative
    decoding).
    """

    rows: tuple[int, ...]
    input_lengths: tuple[int, ...]
    max_model_len: int
    reserve: int


@attrs.frozen
class CapArgumentError(CoreError):
    """An argument is out of range: ``argument`` names it, ``values`` holds what was given.

    For ``input_lengths`` out of ``[0, MAX_INPUT_LENGTH]``, ``rows`` names every offending
    row (parallel to ``values``); for lengths of the wrong dtype or shape both are empty.
    """

    argument: str
    values: tuple[int, ...]
    rows: tuple[int, ...] = ()


CapFailure = CapError | CapArgumentError
"""Everything the cap functions can refuse with."""


def reserved_tokens(*, num_speculative_tokens: int) -> int:
    """Slots held back before ``max_model_len``: k + 1 with speculative decoding, else 0."""
    return num_speculative_tokens + 1 if num_speculative_tokens > 0 else 0


def _check_scalars(
    max_new_tokens: int, max_model_len: int, num_speculative_tokens: int
) -> CapArgumentError | None:
    if max_new_tokens < 1:
        return CapArgumentError(
            f"max_new_tokens must be at least 1, got {max_new_tokens}",
            argument="max_new_tokens",
            values=(max_new_tokens,),
        )
    if not 1 <= max_model_len <= MAX_SCALAR_ARGUMENT:
        return CapArgumentError(
            f"max_model_len must be between 1 and {MAX_SCALAR_ARGUMENT}, got {max_model_len}",
            argument="max_model_len",
            values=(max_model_len,),
        )
    if not 0 <= num_speculative_tokens <= MAX_SCALAR_ARGUMENT:
        return CapArgumentError(
            "num_speculative_tokens must be between 0 and "
            f"{MAX_SCALAR_ARGUMENT}, got {num_speculative_tokens}",
            argument="num_speculative_tokens",
            values=(num_speculative_tokens,),
        )
    return None


def _describe_reserve(reserve: int) -> str:
    if reserve == 0:
        return ""
    return f" minus {reserve} slots reserved for speculative decoding (k + 1)"


def no_room_error(
    rows: tuple[int, ...], lengths: tuple[int, ...], max_model_len: int, reserve: int
) -> CapError:
    """The :class:`CapError` naming ``rows`` (with their ``lengths``) as without room."""
    limit = max_model_len - reserve
    if len(rows) == 1:
        head = f"row {rows[0]} (input length {lengths[0]}) leaves no room to generate"
    else:
        listed = ", ".join(f"{r} (input length {n})" for r, n in zip(rows, lengths, strict=True))
        head = f"{len(rows)} rows leave no room to generate: rows {listed}"
    return CapError(
        f"{head}; input length must be below {limit} "
        f"(max_model_len {max_model_len}{_describe_reserve(reserve)})",
        rows=rows,
        input_lengths=lengths,
        max_model_len=max_model_len,
        reserve=reserve,
    )


def _capped(
    max_new_tokens: int, input_length: int, max_model_len: int, reserve: int
) -> Result[int, CapFailure]:
    room = max_model_len - reserve - input_length
    if room < 1:
        return Failure(no_room_error((0,), (input_length,), max_model_len, reserve))
    return Success(min(max_new_tokens, room))


def _bad_lengths(rows: tuple[int, ...], values: tuple[int, ...]) -> CapArgumentError:
    listed = ", ".join(f"{r} ({n})" for r, n in zip(rows, values, strict=True))
    return CapArgumentError(
        f"input lengths must be between 0 and {MAX_INPUT_LENGTH}; out of range at rows {listed}",
        argument="input_lengths",
        values=values,
        rows=rows,
    )


def _check_request(
    max_new_tokens: int, input_length: int, max_model_len: int, num_speculative_tokens: int
) -> CapArgumentError | None:
    bad = _check_scalars(max_new_tokens, max_model_len, num_speculative_tokens)
    if bad is None and not 0 <= input_length <= MAX_INPUT_LENGTH:
        bad = _bad_lengths((0,), (input_length,))
    return bad


def context_cap(
    max_new_tokens: int, input_length: int, max_model_len: int
) -> Result[int, CapFailure]:
    """``min(max_new_tokens, max_model_len - input_length)``; refused below 1 token."""
    bad = _check_request(max_new_tokens, input_length, max_model_len, 0)
    if bad is not None:
        return Failure(bad)
    return _capped(max_new_tokens, input_length, max_model_len, 0)


def spec_decode_cap(
    max_new_tokens: int, input_length: int, max_model_len: int, num_speculative_tokens: int
) -> Result[int, CapFailure]:
    """``min(max_new_tokens, max_model_len - input_length - (k + 1))``; refused below 1.

    The formula holds for any k >= 0 (k = 0 reserves the one bonus slot);
    :func:`request_max_tokens` applies it only when speculative decoding is on (k > 0).
    """
    bad = _check_request(max_new_tokens, input_length, max_model_len, num_speculative_tokens)
    if bad is not None:
        return Failure(bad)
    return _capped(max_new_tokens, input_length, max_model_len, num_speculative_tokens + 1)


def request_max_tokens(
    max_new_tokens: int,
    input_length: int,
    max_model_len: int,
    *,
    cap_to_context: bool,
    num_speculative_tokens: int,
) -> Result[int, CapFailure]:
    """The ``max_tokens`` one request may ask for.

    With speculative decoding (k > 0) the clamp applies (it is tighter than the context cap);
    else with ``cap_to_context`` the context cap; else ``max_new_tokens`` unchanged (vLLM
    stops at ``max_model_len`` itself).
    """
    bad = _check_request(max_new_tokens, input_length, max_model_len, num_speculative_tokens)
    if bad is not None:
        return Failure(bad)
    if num_speculative_tokens > 0:
        return _capped(max_new_tokens, input_length, max_model_len, num_speculative_tokens + 1)
    if cap_to_context:
        return _capped(max_new_tokens, input_length, max_model_len, 0)
    return Success(max_new_tokens)


def _lengths_array(
    input_lengths: Sequence[int] | torch.Tensor,
) -> npt.NDArray[np.int64] | CapArgumentError:
    """The lengths as a 1-D int64 array, or why they are not a 1-D integer sequence that
    fits in int64."""
    if isinstance(input_lengths, torch.Tensor):
        if (
            input_lengths.dim() != 1
            or input_lengths.dtype.is_floating_point
            or input_lengths.dtype.is_complex
            or input_lengths.dtype == torch.bool
        ):
            return CapArgumentError(
                "input_lengths must be a 1-D integer tensor, got shape "
                f"{tuple(input_lengths.shape)} dtype {input_lengths.dtype}",
                argument="input_lengths",
                values=(),
            )
        return input_lengths.detach().to(device="cpu", dtype=torch.int64).numpy()
    if isinstance(input_lengths, str | bytes):
        kind = type(input_lengths).__name__
    else:
        # NumPy infers int64, or uint64 when a value is above the int64 range (float64 or
        # object when such values mix with others: refused below, like any non-int).
        array = np.asarray(input_lengths) if len(input_lengths) else np.zeros(0, np.int64)
        if array.ndim == 1 and array.dtype.kind == "i":
            return array.astype(np.int64)
        if array.ndim == 1 and array.dtype.kind == "u":
            too_long = np.flatnonzero(array > MAX_INPUT_LENGTH)
            if too_long.size:
                return _bad_lengths(tuple(too_long.tolist()), tuple(array[too_long].tolist()))
            return array.astype(np.int64)
        kind = f"values of dtype {array.dtype} and shape {array.shape}"
    return CapArgumentError(
        f"input_lengths must be a sequence of ints within int64, got {kind}",
        argument="input_lengths",
        values=(),
    )


def batch_max_tokens(
    max_new_tokens: int,
    input_lengths: Sequence[int] | torch.Tensor,
    max_model_len: int,
    *,
    cap_to_context: bool,
    num_speculative_tokens: int,
) -> Result[tuple[int, ...], CapFailure]:
    """:func:`request_max_tokens` for every row at once (vectorised).

    The error names every offending row: all lengths outside ``[0, MAX_INPUT_LENGTH]`` (a
    :class:`CapArgumentError`, checked first), else all rows without room (a
    :class:`CapError`).
    """
    bad = _check_scalars(max_new_tokens, max_model_len, num_speculative_tokens)
    if bad is not None:
        return Failure(bad)
    lengths = _lengths_array(input_lengths)
    if isinstance(lengths, CapArgumentError):
        return Failure(lengths)
    negative = np.flatnonzero(lengths < 0)
    if negative.size:
        return Failure(_bad_lengths(tuple(negative.tolist()), tuple(lengths[negative].tolist())))
    if num_speculative_tokens == 0 and not cap_to_context:
        return Success((max_new_tokens,) * lengths.size)
    reserve = reserved_tokens(num_speculative_tokens=num_speculative_tokens)
    limit = max_model_len - reserve
    # Clip first so the subtraction stays inside int64 whatever the lengths; any length above
    # max_model_len already leaves no room, and the clip keeps that.
    clipped = np.minimum(lengths, max_model_len)
    room = limit - clipped
    no_room = np.flatnonzero(room < 1)
    if no_room.size:
        rows = tuple(no_room.tolist())
        values = tuple(lengths[no_room].tolist())
        return Failure(no_room_error(rows, values, max_model_len, reserve))
    ceiling = min(max_new_tokens, limit)
    return Success(tuple(np.minimum(room, ceiling).tolist()))


@attrs.frozen
class RowCaps:
    """Each row's ``max_tokens`` (0 for a row without room) and why rows were refused."""

    max_tokens: tuple[int, ...]
    refused: CapError | None = None

    @property
    def refused_rows(self) -> tuple[int, ...]:
        return () if self.refused is None else self.refused.rows


def cap_rows(
    max_new_tokens: int,
    input_lengths: Sequence[int] | torch.Tensor,
    max_model_len: int,
    *,
    cap_to_context: bool,
    num_speculative_tokens: int,
) -> Result[RowCaps, CapArgumentError]:
    """:func:`batch_max_tokens`, but rows without room are refused alone (``max_tokens`` 0,
    named in ``refused``) instead of failing the batch; argument errors still fail it."""
    result = batch_max_tokens(
        max_new_tokens,
        input_lengths,
        max_model_len,
        cap_to_context=cap_to_context,
        num_speculative_tokens=num_speculative_tokens,
    )
    if isinstance(result, Success):
        return Success(RowCaps(result.unwrap()))
    error = result.failure()
    if isinstance(error, CapArgumentError):
        return Failure(error)
    lengths = _lengths_array(input_lengths)
    assert not isinstance(lengths, CapArgumentError)  # batch_max_tokens accepted them
    refused = set(error.rows)
    kept = [i for i in range(lengths.size) if i not in refused]
    caps = batch_max_tokens(
        max_new_tokens,
        lengths[kept].tolist(),
        max_model_len,
        cap_to_context=cap_to_context,
        num_speculative_tokens=num_speculative_tokens,
    )
    out = [0] * lengths.size
    for row, cap in zip(kept, caps.unwrap(), strict=True):
        out[row] = cap
    return Success(RowCaps(tuple(out), error))
