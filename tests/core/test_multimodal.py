"""Laws and documented cases of the multimodal batch checks (images vs placeholder ids)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given
from returns.result import Failure, Success
from strategies import MediaBatch, media_batches, st

from genworker.core.multimodal import (
    MEDIA_KEY,
    ContextError,
    MediaError,
    MediaErrorKind,
    MediaLayoutError,
    RawMedia,
    UnreadExpansion,
    check_context,
    check_media,
    check_media_by_info,
    check_text_room,
    expanded_length,
    image_token_id,
    media_layout,
)

IMAGE = 4  # the tiny Idefics3's <image> id
# What vLLM makes of "<s><image> Describe" there: <fake><global-img><image>x4<fake>.
EXPANDED_ROW = [0, 3, 6, IMAGE, IMAGE, IMAGE, IMAGE, 3, 263, 394]

Verdict = tuple[MediaErrorKind, tuple[int, ...]] | None


def reference_verdict(batch: MediaBatch) -> Verdict:
    """The module docstring's rules, one row at a time."""
    rows = list(enumerate(zip(batch.prompts, batch.image_counts, strict=True)))
    pid = batch.placeholder_id
    if pid is None:
        with_images = tuple(r for r, (_, n) in rows if n)
        return (MediaErrorKind.TEXT_ONLY_MODEL, with_images) if with_images else None
    if batch.max_images is not None:
        over = tuple(r for r, (_, n) in rows if n > batch.max_images)
        if over:
            return MediaErrorKind.IMAGE_LIMIT, over

    def adjacent(prompt: list[int]) -> bool:
        return any(a == pid and b == pid for a, b in itertools.pairwise(prompt))

    rules: tuple[tuple[MediaErrorKind, Callable[[list[int], int], bool]], ...] = (
        (MediaErrorKind.EXPANDED, lambda p, n: p.count(pid) > n and adjacent(p)),
        (MediaErrorKind.EXTRA_IMAGES, lambda p, n: n > p.count(pid)),
        (MediaErrorKind.MISSING_IMAGES, lambda p, n: p.count(pid) > n),
    )
    for kind, broken in rules:
        bad = tuple(r for r, (p, n) in rows if broken(p, n))
        if bad:
            return kind, bad
    return None


@given(media_batches())
def test_check_media_follows_the_rules_and_names_every_offending_row(batch: MediaBatch) -> None:
    result = check_media(
        batch.prompts,
        batch.image_counts,
        placeholder_id=batch.placeholder_id,
        max_images=batch.max_images,
    )
    verdict = reference_verdict(batch)
    if verdict is None:
        assert isinstance(result, Success)
        assert result.unwrap() == tuple(r for r, n in enumerate(batch.image_counts) if n)
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert (error.kind, error.rows) == verdict
    assert error.images == tuple(batch.image_counts[r] for r in error.rows)
    expected_placeholders = tuple(
        0 if batch.placeholder_id is None else batch.prompts[r].count(batch.placeholder_id)
        for r in error.rows
    )
    assert error.placeholders == expected_placeholders
    assert all(f"row {r} " in error.message for r in error.rows)


@given(media_batches(), st.integers(0, 3))
def test_one_placeholder_per_image_always_passes(batch: MediaBatch, placeholder: int) -> None:
    counts = [p.count(placeholder) for p in batch.prompts]
    result = check_media(batch.prompts, counts, placeholder_id=placeholder, max_images=None)
    assert isinstance(result, Success)
    assert result.unwrap() == tuple(r for r, n in enumerate(counts) if n)


def _error(
    prompts: list[list[int]],
    counts: list[int],
    placeholder_id: int | None = IMAGE,
    max_images: int | None = None,
) -> MediaError:
    result = check_media(prompts, counts, placeholder_id=placeholder_id, max_images=max_images)
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, MediaError)
    return error


def test_a_prompt_vllm_already_expanded_is_refused_naming_the_row() -> None:
    error = _error([[0, IMAGE, 263], EXPANDED_ROW], [1, 1])
    assert (error.kind, error.rows, error.placeholders) == (MediaErrorKind.EXPANDED, (1,), (4,))
    assert "already expanded" in error.message
    assert "row 1 (4 placeholders, 1 images)" in error.message


def test_adjacent_placeholders_for_as_many_images_are_fine() -> None:
    result = check_media([[0, IMAGE, IMAGE, 9]], [2], placeholder_id=IMAGE, max_images=2)
    assert result == Success((0,))


def test_more_images_than_placeholders_and_the_reverse_are_refused() -> None:
    extra = _error([[0, IMAGE, 9], [0, 9]], [2, 0])
    assert (extra.kind, extra.rows, extra.images) == (MediaErrorKind.EXTRA_IMAGES, (0,), (2,))
    missing = _error([[0, IMAGE, 9], [0, IMAGE, 9, IMAGE]], [1, 1])
    assert (missing.kind, missing.rows) == (MediaErrorKind.MISSING_IMAGES, (1,))
    # a placeholder id in a row without images would stay text in vLLM
    stray = _error([[0, 9], [IMAGE, 9]], [0, 0])
    assert (stray.kind, stray.rows) == (MediaErrorKind.MISSING_IMAGES, (1,))


def test_images_for_a_text_only_model_are_refused_and_text_rows_pass() -> None:
    error = _error([[0, 4], [0, 5]], [0, 2], placeholder_id=None)
    assert (error.kind, error.rows, error.images) == (MediaErrorKind.TEXT_ONLY_MODEL, (1,), (2,))
    assert check_media([[0, 4]], [0], placeholder_id=None, max_images=None) == Success(())


def test_the_engines_image_limit_is_checked_first() -> None:
    error = _error([[IMAGE, IMAGE, IMAGE], [IMAGE]], [3, 2], max_images=2)
    assert (error.kind, error.rows) == (MediaErrorKind.IMAGE_LIMIT, (0,))
    assert "limit_mm_per_prompt image=2" in error.message


def test_bad_counts_are_programming_errors() -> None:
    with pytest.raises(ValueError, match="2 image counts for 1 prompts"):
        check_media([[1]], [0, 0], placeholder_id=IMAGE, max_images=None)
    with pytest.raises(ValueError, match="negative"):
        check_media([[1]], [-1], placeholder_id=IMAGE, max_images=None)


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), max_size=8),
    st.integers(1, 60),
)
def test_check_context_refuses_exactly_the_rows_whose_expansion_fills_the_context(
    rows: list[tuple[int, int]], max_model_len: int
) -> None:
    lengths = [n for n, _ in rows]
    expanded = [n + extra for n, extra in rows]
    result = check_context(lengths, expanded, max_model_len)
    full = tuple(r for r, e in enumerate(expanded) if e >= max_model_len)
    if not full:
        assert result == Success(None)
        return
    assert isinstance(result, Failure)
    error = result.failure()
    assert isinstance(error, ContextError)
    assert error.rows == full
    assert error.lengths == tuple(lengths[r] for r in full)
    assert error.expanded == tuple(expanded[r] for r in full)
    assert error.max_model_len == max_model_len
    assert all(f"row {r} (length {lengths[r]}, expanded {expanded[r]})" in str(error) for r in full)


@given(st.dictionaries(st.integers(0, 7), st.integers(1, 60), max_size=8), st.integers(1, 60))
def test_check_text_room_refuses_exactly_the_texts_that_fill_the_context(
    lengths: dict[int, int], max_model_len: int
) -> None:
    result = check_text_room("generate", lengths, max_model_len)
    full = [row for row, n in lengths.items() if n >= max_model_len]
    if not full:
        assert result == Success(None)
        return
    assert isinstance(result, Failure)
    assert str(result.failure()) == (
        f"generate: vllm_content of rows {full} leaves no room to generate: "
        f"{[lengths[r] for r in full]} tokens, max_model_len={max_model_len}"
    )


def test_check_context_refuses_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="1 expanded lengths for 2 prompts"):
        check_context([1, 2], [8], 10)
    with pytest.raises(ValueError, match=r"rows \[1\] have expanded lengths below"):
        check_context([1, 5], [8, 4], 10)


_A, _B = object(), object()  # images: core never looks inside them


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, None),
        ({MEDIA_KEY: None, "vllm_images": [[], None], "vllm_audios": [None]}, None),
        ({MEDIA_KEY: [None, {"image": None}, {"image": []}]}, None),
        (
            {MEDIA_KEY: [{"image": _A}, None, {"image": (_A, _B)}]},
            [
                RawMedia((_A,), "c: multi_modal_data[0]['image']"),
                None,
                RawMedia((_A, _B), "c: multi_modal_data[2]['image']"),
            ],
        ),
        (
            {"vllm_images": [[_A], [], (_B,)], "vllm_content": ["text", "other", None]},
            [
                RawMedia((_A,), "c: vllm_images[0]", "text"),
                None,
                RawMedia((_B,), "c: vllm_images[2]"),
            ],
        ),
        ({"vllm_images": [None, [_A], []]}, [None, RawMedia((_A,), "c: vllm_images[1]"), None]),
    ],
)
def test_the_layout_finds_each_rows_images_and_text(
    data: dict[str, object], expected: list[RawMedia | None] | None
) -> None:
    assert media_layout(data, 3, "c") == Success(expected)


@pytest.mark.parametrize(
    ("data", "texts", "key", "error"),
    [
        (
            {"vllm_videos": [[_A]], "vllm_audios": 1},
            True,
            "vllm_audios",
            "['vllm_audios', 'vllm_videos'] carry",
        ),
        ({"vllm_videos": "clip"}, True, "vllm_videos", "carry audio or video"),
        ({"vllm_content": [None, "hi"]}, False, "vllm_content", "is for generate"),
        ({MEDIA_KEY: [{"image": _A}], "vllm_images": [[_A]]}, True, MEDIA_KEY, "keep one"),
        ({"vllm_images": [[_A]]}, True, "vllm_images", "has 1 entries for 2 rows"),
        ({"vllm_images": ([_A], [])}, True, "vllm_images", None),
        ({"vllm_images": [[_A], []], "vllm_content": "hi"}, True, "vllm_content", "must be a list"),
        ({"vllm_images": [_A, []]}, True, "vllm_images", "c: vllm_images[0] must be a list"),
        ({"vllm_images": [[_A], []], "vllm_content": ["", None]}, True, "vllm_content", "[0] must"),
        ({"vllm_images": [[_A], []], "vllm_content": [None, 3]}, True, "vllm_content", "got 3"),
        ({MEDIA_KEY: b"xy"}, True, MEDIA_KEY, "must be a list with one entry per row, got bytes"),
        ({MEDIA_KEY: [None, _A]}, True, MEDIA_KEY, "[1] must be None or a mapping, got object"),
        (
            {MEDIA_KEY: [{"audio": _A}, None]},
            True,
            MEDIA_KEY,
            "only 'image' is supported, got ['audio']",
        ),
    ],
)
def test_a_layout_it_cannot_read_is_refused_naming_the_key(
    data: dict[str, object], texts: bool, key: str, error: str | None
) -> None:
    result = media_layout(data, 2, "c", texts=texts)
    if error is None:  # a tuple of rows is a list of rows too
        assert result == Success([RawMedia((_A,), "c: vllm_images[0]"), None])
        return
    assert isinstance(result, Failure)
    problem = result.failure()
    assert isinstance(problem, MediaLayoutError)
    assert problem.key == key
    assert error in str(problem)
    assert str(problem).startswith("c: ")


@given(media_batches(), st.sets(st.integers(0, 5)))
def test_checking_by_info_is_check_media_without_the_text_rows(
    batch: MediaBatch, text_rows: set[int]
) -> None:
    info = {"image_token_id": batch.placeholder_id, "max_images": batch.max_images}
    expected = check_media(
        [() if r in text_rows else p for r, p in enumerate(batch.prompts)],
        [0 if r in text_rows else n for r, n in enumerate(batch.image_counts)],
        placeholder_id=batch.placeholder_id,
        max_images=batch.max_images,
    )
    assert check_media_by_info(batch.prompts, batch.image_counts, info, text_rows=text_rows) == (
        expected
    )


def test_an_info_value_that_is_not_an_int_is_unknown() -> None:
    info = {"image_token_id": "7", "max_images": 1.0}
    assert check_media_by_info([[IMAGE]], [1], info) == check_media(
        [[IMAGE]], [1], placeholder_id=None, max_images=None
    )
    assert isinstance(check_media_by_info([[IMAGE]], [1], info), Failure)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"image_token_id": 49190, "image_token_index": 7}, 49190),  # Idefics3, Qwen2-VL
        ({"image_token_id": None, "image_token_index": 32000}, 32000),  # LLaVA, Gemma 3
        ({"image_token_id": True, "image_token_index": "<image>"}, None),  # no id in either
        ({}, None),  # a text-only model's config
    ],
)
def test_the_image_placeholder_is_the_first_field_that_holds_an_id(
    fields: dict[str, object], expected: int | None
) -> None:
    assert image_token_id(fields) == expected


@given(st.lists(st.integers(0, 100), max_size=12), st.integers(0, 12))
def test_an_expansion_is_read_only_when_it_holds_at_least_the_prompt(
    rendered: list[int], length: int
) -> None:
    result = expanded_length(3, length, rendered)
    if len(rendered) >= length:
        assert result == Success(len(rendered))
        return
    assert isinstance(result, Failure)
    assert result.failure() == UnreadExpansion(result.failure().message, row=3)
    assert str(result.failure()).startswith(f"multi_modal_data[3]: vLLM rendered {length} ")


def test_an_expansion_that_is_no_list_of_ids_is_refused() -> None:
    result = expanded_length(0, 2, None)
    assert isinstance(result, Failure)
    assert str(result.failure()) == "multi_modal_data[0]: vLLM rendered 2 prompt ids as None"
