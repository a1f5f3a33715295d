"""Checks on a right-padded batch of token ids, and the prompts it holds.

Theory of operation. A batch arrives as NeMo-RL's ``GenerationDatumSpec`` gives it:
``input_ids`` (B, P), right-padded with the pad id, and ``input_lengths`` (B,), the number
of real tokens in each row. NeMo-RL checks only the padding
(``nemo_rl/models/generation/interfaces.py``, ``verify_right_padding``) and raises on the
first problem; a negative length slips through it and becomes an empty prompt that vLLM
rejects mid-batch. Here every rule is checked, in this order, and the first rule that fails
is reported with *all* its offending rows:

1. ``input_ids`` is a 2-D integer tensor, ``input_lengths`` a 1-D integer tensor, and both
   have the same batch size (bool and float dtypes are refused; a (B, 1) lengths tensor is
   refused rather than silently flattened). Both are plain dense tensors holding data:
   sparse and nested layouts, the meta device and wrapper subclasses that dispatch every
   op themselves (fake, masked tensors) are refused, since their values cannot be read.
   ``output_ids`` keeps the dtype of ``input_ids`` (NeMo-RL's contract), so that dtype
   must hold every id the outputs can carry: the pad id and ``vocab_size - 1`` (without a
   known vocabulary, the largest id vLLM can emit, ``2**31 - 1``: its token ids are int32,
   ``vllm/v1/worker/gpu_input_batch.py``, 0.32); an int8 batch would wrap generated ids.
2. Every length lies in [1, P]: vLLM refuses an empty prompt, and a length past the width
   would read tokens that are not there.
3. Every position at or after a row's length holds the pad id (right padding).
4. Every token inside a row's unpadded span is non-negative and, when the vocabulary size
   is known, below it. Padding is not checked: the pad id need not be a real token.
5. When ``max_model_len`` is known, every length is below it, so each row has room for at
   least one generated token (vLLM's context limit counts prompt plus output).

All checks are masks over the whole batch; no Python loop runs per token. A batch that
passes is seen only by NumPy (:func:`_well_formed`, single-threaded, about 0.5 ms for
512 x 128): torch's CPU ops over a batch that size split across its OpenMP threads and
wait for all of them, and one thread whose CPU is busy stalls each op (4 ms for the checks
on one thread, 81 ms with one of two cores busy, on the 2-core dev host; issue 20's 60 ms
before the engine call on the H200 host). The tensor masks only name what is wrong in a
batch that fails. An empty batch (B == 0) is valid whatever its width and holds no prompts.

Per-row sampling seeds (``data["seeds"]``) are checked by :func:`check_seeds`: ints (or
None, unseeded) in ``[0, 2**63)``. vLLM accepts any int in ``SamplingParams`` and only
uses it when it schedules the request, inside ``execute_model`` after the request was
admitted: the CPU runner of 0.32 seeds a ``torch.Generator`` (``manual_seed``, which
overflows past ``2**64 - 1``), the GPU model runner V2 of 0.25 stores seeds in an int64
tensor (``OverflowError`` from ``2**63``, measured on the H200). The range is the one
every engine takes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "MAX_TOKEN_ID",
    "SEED_LIMIT",
    "BatchError",
    "BatchErrorKind",
    "BatchFieldError",
    "CheckedBatch",
    "batch_tensors",
    "check_batch",
    "check_seeds",
    "extract_prompts",
    "pad_rows",
]

_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_SEED_DTYPES = _INTEGER_DTYPES | {torch.uint16, torch.uint32, torch.uint64}

MAX_TOKEN_ID = 2**31 - 1
"""The largest token id vLLM can emit (its token ids are int32)."""

SEED_LIMIT = 2**63
"""Sampling seeds lie in ``[0, SEED_LIMIT)``: int64, what every engine's runner takes."""


class BatchErrorKind(enum.StrEnum):
    """Which rule of a batch was broken (see the module docstring for the order)."""

    INPUT_IDS = "input_ids"
    INPUT_LENGTHS = "input_lengths"
    BATCH_SIZE = "batch_size"
    LENGTH = "length"
    PADDING = "padding"
    TOKEN_ID = "token_id"
    MAX_MODEL_LEN = "max_model_len"
    SEEDS = "seeds"


@attrs.frozen
class BatchFieldError(CoreError):
    """A ``generate`` call's ``data`` that is not a mapping (``key`` empty) or lacks the
    tensor ``key``."""

    key: str = ""


def batch_tensors(data: object) -> Result[tuple[torch.Tensor, torch.Tensor], BatchFieldError]:
    """``data["input_ids"]`` and ``data["input_lengths"]``, or why ``data`` does not hold
    them as tensors (naming the key)."""
    if not isinstance(data, Mapping):
        return Failure(BatchFieldError(f"data must be a mapping, got {type(data).__name__}"))
    tensors = []
    for key in ("input_ids", "input_lengths"):
        value = data.get(key)
        if value is None:
            return Failure(BatchFieldError(f"data[{key!r}] is missing", key=key))
        if not isinstance(value, torch.Tensor):
            message = f"data[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
            return Failure(BatchFieldError(message, key=key))
        tensors.append(value)
    return Success((tensors[0], tensors[1]))


@attrs.frozen
class BatchError(CoreError):
    """A batch that breaks one rule, with every row (and cell) that breaks it.

    ``rows`` lists the offending rows in ascending order, each once; ``cells`` lists the
    offending (row, position) pairs for the padding rule (the first bad position of each
    row) and the token-id rule (every bad token); ``detail`` is the human listing that
    ``message`` ends with.
    """

    kind: BatchErrorKind
    rows: tuple[int, ...] = ()
    detail: str = ""
    cells: tuple[tuple[int, int], ...] = ()


def _check_prompts(instance: CheckedBatch, _attribute: object, prompts: object) -> None:
    del _attribute, prompts
    if len(instance.prompts) != len(instance.lengths):
        raise ValueError(
            f"CheckedBatch has {len(instance.prompts)} prompts but {len(instance.lengths)} lengths"
        )
    if list(map(len, instance.prompts)) == list(instance.lengths):  # one C loop per side
        return
    bad = [
        i
        for i, (prompt, n) in enumerate(zip(instance.prompts, instance.lengths, strict=True))
        if len(prompt) != n
    ]
    raise ValueError(f"CheckedBatch prompts disagree with their lengths in rows {bad}")


@attrs.frozen
class CheckedBatch:
    """A batch that passed :func:`check_batch`: the unpadded prompt of each row, in order."""

    prompts: tuple[list[int], ...] = attrs.field(validator=_check_prompts)
    lengths: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


def extract_prompts(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> list[list[int]]:
    """The unpadded token ids of each row: ``input_ids[i, :input_lengths[i]]`` as lists.

    Trusts its inputs (run :func:`check_batch` first); one ``.tolist()`` of the columns any
    prompt reaches, then each row's list cut to its length in place (the lists are
    ``tolist``'s own: no copy).
    """
    lengths: list[int] = input_lengths.reshape(-1).tolist()
    if len(lengths) != input_ids.shape[0]:
        raise ValueError(
            f"input_lengths has {len(lengths)} entries for {input_ids.shape[0]} rows of input_ids"
        )
    reach = max(lengths, default=0)
    rows: list[list[int]] = input_ids[:, :reach].tolist()
    for row, n in zip(rows, lengths, strict=True):
        if n < reach:
            del row[n:]
    return rows


def pad_rows(rows: Sequence[Sequence[int]], pad: int) -> dict[str, torch.Tensor]:
    """``{"input_ids", "input_lengths"}``: ``rows`` right-padded with ``pad`` (the inverse
    of :func:`extract_prompts`)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return (
            f"a {type(value).__name__} of shape {tuple(value.shape)}, dtype {value.dtype}, "
            f"layout {value.layout} on {value.device}"
        )
    return f"a {type(value).__name__}"


def _unreadable(value: torch.Tensor) -> str | None:
    """Why a tensor's values cannot be read as plain data, or None if they can."""
    if value.is_nested:
        return "a nested tensor"
    if value.layout is not torch.strided:
        return f"a {value.layout} tensor (not dense)"
    if value.device.type == "meta":
        return "a meta tensor (it holds no data)"
    if type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return f"a {type(value).__name__} (a tensor subclass that dispatches its own ops)"
    return None


def _plain_tensor(
    name: str, value: object, dim: int, dtypes: frozenset[torch.dtype], kind: BatchErrorKind
) -> torch.Tensor | BatchError:
    """``value`` if it is a plain ``dim``-D tensor of one of ``dtypes``, else the error."""
    if not isinstance(value, torch.Tensor) or value.dim() != dim or value.dtype not in dtypes:
        shape = "(batch, width)" if dim == 2 else "(batch,)"
        kinds = "int8 to int64, or uint8" if dtypes is _INTEGER_DTYPES else "int or uint"
        detail = f"got {_describe(value)}"
        return BatchError(
            message=f"{name} must be a {dim}-D integer tensor {shape} ({kinds}); {detail}",
            kind=kind,
            detail=detail,
        )
    unreadable = _unreadable(value)
    if unreadable is not None:
        detail = f"got {unreadable}: {_describe(value)}"
        return BatchError(
            message=f"{name} must be a dense tensor holding data; {detail}",
            kind=kind,
            detail=detail,
        )
    return value


def _capacity_error(
    dtype: torch.dtype, pad_token_id: int, vocab_size: int | None
) -> BatchError | None:
    """The error if ``dtype`` cannot hold the pad id or every id the engine can generate."""
    info = torch.iinfo(dtype)
    largest = (
        ("the largest id vLLM emits", MAX_TOKEN_ID)
        if vocab_size is None
        else ("the largest token id (vocab_size - 1)", vocab_size - 1)
    )
    for what, value in (("the pad id", pad_token_id), largest):
        if not info.min <= value <= info.max:
            detail = f"{dtype} holds [{info.min}, {info.max}], not {what} {value}"
            return BatchError(
                message=(
                    f"input_ids dtype {dtype} cannot hold the output ids (output_ids keeps "
                    f"the input dtype): {detail}; send int32 or int64"
                ),
                kind=BatchErrorKind.INPUT_IDS,
                detail=detail,
            )
    return None


def _shape_error(
    input_ids: object, input_lengths: object, pad_token_id: int, vocab_size: int | None
) -> BatchError | tuple[torch.Tensor, torch.Tensor]:
    ids = _plain_tensor("input_ids", input_ids, 2, _INTEGER_DTYPES, BatchErrorKind.INPUT_IDS)
    if isinstance(ids, BatchError):
        return ids
    lengths = _plain_tensor(
        "input_lengths", input_lengths, 1, _INTEGER_DTYPES, BatchErrorKind.INPUT_LENGTHS
    )
    if isinstance(lengths, BatchError):
        return lengths
    if ids.shape[0] != lengths.shape[0]:
        detail = f"input_ids has {ids.shape[0]} rows, input_lengths has {lengths.shape[0]} entries"
        return BatchError(
            message=f"input_ids and input_lengths disagree on the batch size: {detail}",
            kind=BatchErrorKind.BATCH_SIZE,
            detail=detail,
        )
    problem = _capacity_error(ids.dtype, pad_token_id, vocab_size)
    if problem is not None:
        return problem
    return ids, lengths


def _rows_with_lengths(mask: torch.Tensor, lengths: torch.Tensor) -> tuple[tuple[int, ...], str]:
    rows: list[int] = mask.nonzero().flatten().tolist()
    values: list[int] = lengths[mask].tolist()
    detail = ", ".join(f"row {r} (length {n})" for r, n in zip(rows, values, strict=True))
    return tuple(rows), detail


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _padding_error(
    ids: torch.Tensor, tail: torch.Tensor, lengths: torch.Tensor, pad_token_id: int
) -> BatchError | None:
    bad = tail & (ids != pad_token_id)
    bad_rows = bad.any(dim=1)
    if not bool(bad_rows.any()):
        return None
    rows: list[int] = bad_rows.nonzero().flatten().tolist()
    # argmax returns the first maximal index: the first non-pad position past the length.
    first: list[int] = bad[bad_rows].to(torch.uint8).argmax(dim=1).tolist()
    tokens: list[int] = ids[rows, first].tolist()
    row_lengths: list[int] = lengths[bad_rows].tolist()
    detail = ", ".join(
        f"row {r} (token {t} at position {p}, length {n})"
        for r, p, t, n in zip(rows, first, tokens, row_lengths, strict=True)
    )
    return BatchError(
        message=(
            f"input_ids is not right-padded with pad id {pad_token_id} in "
            f"{_plural(len(rows), 'row')}: {detail}"
        ),
        kind=BatchErrorKind.PADDING,
        rows=tuple(rows),
        detail=detail,
        cells=tuple(zip(rows, first, strict=True)),
    )


def _token_error(
    ids: torch.Tensor, tail: torch.Tensor, vocab_size: int | None
) -> BatchError | None:
    out_of_range = ids < 0
    if vocab_size is not None:
        out_of_range |= ids >= vocab_size
    bad = out_of_range & ~tail
    if not bool(bad.any()):
        return None
    where = bad.nonzero()
    cells: list[list[int]] = where.tolist()
    values: list[int] = ids[bad].tolist()
    rows: list[int] = bad.any(dim=1).nonzero().flatten().tolist()
    detail = ", ".join(
        f"row {r} position {p} (id {v})" for (r, p), v in zip(cells, values, strict=True)
    )
    bound = "negative" if vocab_size is None else f"outside [0, {vocab_size})"
    return BatchError(
        message=(
            f"input_ids holds {_plural(len(values), 'token id')} {bound} inside the "
            f"prompts: {detail}"
        ),
        kind=BatchErrorKind.TOKEN_ID,
        rows=tuple(rows),
        detail=detail,
        cells=tuple((r, p) for r, p in cells),
    )


def _well_formed(
    ids: torch.Tensor,
    lengths: torch.Tensor,
    pad_token_id: int,
    vocab_size: int | None,
    max_model_len: int | None,
) -> bool:
    """Whether a non-empty batch of the right shapes and dtypes keeps rules 2-5, in NumPy
    (see the module docstring)."""
    a, n = ids.cpu().numpy(), lengths.cpu().numpy()
    width = a.shape[1]
    if n.min() < 1 or n.max() > width or (max_model_len is not None and n.max() >= max_model_len):
        return False
    tail = np.arange(width) >= n[:, None]
    inside = a[~tail]
    if (a[tail] != pad_token_id).any() or inside.min() < 0:
        return False
    return vocab_size is None or bool(inside.max() < vocab_size)


def check_batch(
    input_ids: object,
    input_lengths: object,
    *,
    pad_token_id: int,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> Result[CheckedBatch, BatchError]:
    """Check a right-padded batch and extract its prompts.

    ``input_ids`` and ``input_lengths`` are typed ``object`` because they come straight
    from a caller's data dict; anything but the documented tensors is an error value.
    """
    shaped = _shape_error(input_ids, input_lengths, pad_token_id, vocab_size)
    if isinstance(shaped, BatchError):
        return Failure(shaped)
    ids_in, lengths_in = shaped
    if ids_in.shape[0] == 0:
        return Success(CheckedBatch(prompts=(), lengths=()))
    if _well_formed(ids_in, lengths_in, pad_token_id, vocab_size, max_model_len):
        prompts = extract_prompts(ids_in, lengths_in)
        return Success(CheckedBatch(prompts=tuple(prompts), lengths=tuple(map(len, prompts))))
    return Failure(_first_problem(ids_in, lengths_in, pad_token_id, vocab_size, max_model_len))


def _first_problem(
    ids_in: torch.Tensor,
    lengths_in: torch.Tensor,
    pad_token_id: int,
    vocab_size: int | None,
    max_model_len: int | None,
) -> BatchError:
    """The first of rules 2-5 a batch breaks, with all its offenders (tensor masks)."""
    width = ids_in.shape[1]
    ids = ids_in.to(torch.int64)
    lengths = lengths_in.to(torch.int64)

    out_of_width = (lengths < 1) | (lengths > width)
    if bool(out_of_width.any()):
        rows, detail = _rows_with_lengths(out_of_width, lengths)
        return BatchError(
            message=(
                f"input_lengths has {_plural(len(rows), 'row')} outside [1, {width}] "
                f"(the padded width of input_ids): {detail}"
            ),
            kind=BatchErrorKind.LENGTH,
            rows=rows,
            detail=detail,
        )

    tail = torch.arange(width, device=ids.device).unsqueeze(0) >= lengths.unsqueeze(1)
    problem = _padding_error(ids, tail, lengths, pad_token_id)
    if problem is None:
        problem = _token_error(ids, tail, vocab_size)
    if problem is not None:
        return problem
    # _well_formed refused the batch, so it leaves no room to generate in some row
    assert max_model_len is not None
    no_room = lengths >= max_model_len
    rows, detail = _rows_with_lengths(no_room, lengths)
    assert rows, "genworker bug: _well_formed refused a batch that keeps every rule"
    return BatchError(
        message=(
            f"input_lengths leaves no room to generate under max_model_len "
            f"{max_model_len} in {_plural(len(rows), 'row')}: {detail}"
        ),
        kind=BatchErrorKind.MAX_MODEL_LEN,
        rows=rows,
        detail=detail,
    )


def check_seeds(value: object, batch_size: int) -> Result[tuple[int | None, ...], BatchError]:
    """Per-row sampling seeds: ``None`` (unseeded), or a list, tuple or plain 1-D integer
    tensor with one entry per row, each an int in ``[0, SEED_LIMIT)`` or None (that row
    unseeded). The error names every offending row."""
    if value is None:
        return Success((None,) * batch_size)
    if isinstance(value, torch.Tensor):
        tensor = _plain_tensor("data['seeds']", value, 1, _SEED_DTYPES, BatchErrorKind.SEEDS)
        if isinstance(tensor, BatchError):
            return Failure(tensor)
        value = tensor.tolist()
    if not isinstance(value, list | tuple) or len(value) != batch_size:
        detail = f"got {_describe(value)}" + (
            f" of {len(value)}" if isinstance(value, list | tuple) else ""
        )
        return Failure(
            BatchError(
                message=f"data['seeds'] must hold one seed per row ({batch_size}); {detail}",
                kind=BatchErrorKind.SEEDS,
                detail=detail,
            )
        )
    seeds: list[int | None] = []
    bad: list[int] = []
    for row, seed in enumerate(value):
        if seed is None or (type(seed) is int and 0 <= seed < SEED_LIMIT):
            seeds.append(seed)
        else:
            bad.append(row)
    if bad:
        detail = ", ".join(f"row {i} (seed {value[i]!r})" for i in bad)
        return Failure(
            BatchError(
                message=(
                    "data['seeds'] must be ints in [0, 2**63) (int64, the range every "
                    f"engine takes) or None, not in {_plural(len(bad), 'row')}: {detail}"
                ),
                kind=BatchErrorKind.SEEDS,
                rows=tuple(bad),
                detail=detail,
            )
        )
    return Success(tuple(seeds))
