"""Images against placeholder ids: the pure checks of a multimodal batch.

Theory of operation
-------------------
A multimodal row is a token prompt plus images. vLLM's multimodal processor
(``BaseMultiModalProcessor.apply``, ``vllm/multimodal/processing``, vLLM 0.32) replaces each
image placeholder id of a token prompt (Idefics3: ``<image>``) by that image's whole
placeholder sequence (7 ids for the tiny Idefics3), in order, one placeholder per image.
Its failures are deep or silent:

* more images than placeholders: ``AssertionError: Failed to apply prompt replacement for
  mm_items['image'][k]`` from inside the processor;
* more placeholders than images: the extra placeholders stay in the prompt as text;
* an already-expanded prompt (a caller that passes back vLLM's ``prompt_token_ids``): the
  first placeholder is expanded again and the others stay text;
* images for a model without an image placeholder (a text-only model);
* more images in one prompt than the engine's ``limit_mm_per_prompt``: one error for the
  whole batch.

:func:`check_media` refuses all of these before anything is submitted, from counts only:
the shell passes each row's token ids, its number of images, the model's placeholder id
(``None`` for a model that takes no images) and the engine's per-prompt image limit. The
rules, in this order; the first rule that fails is reported with *all* its rows:

1. ``TEXT_ONLY_MODEL``: a row has images but the model has no image placeholder.
2. ``IMAGE_LIMIT``: a row has more images than the limit.
3. ``EXPANDED``: a row holds more placeholders than images and two placeholder ids next to
   each other, the shape of a prompt vLLM already expanded.
4. ``EXTRA_IMAGES``: a row has more images than placeholders.
5. ``MISSING_IMAGES``: a row has more placeholders than images (a row without images that
   holds a placeholder id included).

Images placed next to each other (``<image><image>`` for two images) are fine: rule 3
needs more placeholders than images.

What the context holds is the *expanded* prompt, which only vLLM's processor knows (with
image splitting it depends on each image's size): the shell measures it, and
:func:`check_context` refuses rows whose expanded prompt leaves no room to generate. The
caps of :mod:`genworker.core.caps` take the expanded lengths too. The output contract keeps
the caller's own ids: one placeholder per image, never vLLM's expansion.

Where a batch's images are (:func:`media_layout`, before any is decoded):
``data["multi_modal_data"]`` is a list aligned with the rows, ``None`` for a text-only
row or a mapping whose only key is ``"image"`` (other modalities are refused by name), one
image or a list of them. NeMo-RL's side channels (``nemo_rl/models/generation/vllm/
utils.py``, ``format_prompt_for_vllm_generation``) are ``vllm_images`` (per row a list of
images, empty for a text row) and ``vllm_content`` (per row the conversation as text, or
``None``): a row with images takes its prompt from its ``vllm_content`` when that is a
string (NeMo-RL's ``input_ids`` hold its processor's *expanded* image ids, which vLLM
cannot take back as a token prompt), else from its ids; a row without images uses its ids
whatever its ``vllm_content`` says, as NeMo-RL does. ``vllm_audios`` and ``vllm_videos``
carrying anything are refused by name (images only), as are ``vllm_images`` together with
``multi_modal_data`` (one way in), and ``vllm_content`` for a call whose prompts are text.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Mapping, Sequence

import attrs
from returns.result import Failure, Result, Success

from genworker.core.errors import CoreError

__all__ = [
    "IMAGE_TOKEN_FIELDS",
    "MEDIA_KEY",
    "ContextError",
    "MediaError",
    "MediaErrorKind",
    "MediaLayoutError",
    "RawMedia",
    "UnreadExpansion",
    "check_context",
    "check_media",
    "check_media_by_info",
    "check_text_room",
    "expanded_length",
    "image_token_id",
    "media_layout",
]

MEDIA_KEY = "multi_modal_data"

#: the HF config fields that hold a model's image placeholder id, in the order read:
#: Idefics3's and Qwen2-VL's name, then LLaVA's and Gemma 3's
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")


def image_token_id(fields: Mapping[str, object]) -> int | None:
    """The prompt id that stands for one image, from a model's HF config fields
    (:data:`IMAGE_TOKEN_FIELDS` -> value, None when absent): the first that holds an int
    (a bool is none); None when none does."""
    for name in IMAGE_TOKEN_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class MediaErrorKind(enum.StrEnum):
    """Which rule of a multimodal batch was broken (see the module docstring)."""

    TEXT_ONLY_MODEL = "text_only_model"
    IMAGE_LIMIT = "image_limit"
    EXPANDED = "expanded"
    EXTRA_IMAGES = "extra_images"
    MISSING_IMAGES = "missing_images"


@attrs.frozen
class MediaError(CoreError):
    """A multimodal batch that breaks one rule, with every row that breaks it.

    ``rows`` lists the offending rows in ascending order; ``images`` and ``placeholders``
    (each row's count of placeholder ids; 0 where the model has none) are parallel to it;
    ``detail`` is the listing ``message`` ends with.
    """

    kind: MediaErrorKind
    rows: tuple[int, ...]
    images: tuple[int, ...]
    placeholders: tuple[int, ...]
    detail: str


@attrs.frozen
class ContextError(CoreError):
    """Rows whose expanded prompt fills the context: ``rows``, their caller-side
    ``lengths`` and their ``expanded`` lengths (parallel), and the ``max_model_len``."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    expanded: tuple[int, ...]
    max_model_len: int


def _adjacent(prompt: Sequence[int], placeholder_id: int) -> bool:
    return any(a == b == placeholder_id for a, b in itertools.pairwise(prompt))


def _rows_error(
    kind: MediaErrorKind,
    head: str,
    rows: list[tuple[int, int, int]],
    describe: str,
) -> MediaError:
    detail = ", ".join(describe.format(row=r, images=n, placeholders=p) for r, n, p in rows)
    return MediaError(
        f"{head}: {detail}",
        kind=kind,
        rows=tuple(r for r, _, _ in rows),
        images=tuple(n for _, n, _ in rows),
        placeholders=tuple(p for _, _, p in rows),
        detail=detail,
    )


def check_media(
    prompts: Sequence[Sequence[int]],
    image_counts: Sequence[int],
    *,
    placeholder_id: int | None,
    max_images: int | None,
) -> Result[tuple[int, ...], MediaError]:
    """Check every row's images against its placeholder ids (the module docstring's rules).

    ``image_counts[i]`` is the number of images of row ``i`` (0 for a row without media).
    Returns the rows that carry images, ascending. Counts of the wrong length or negative
    counts are programming errors (``ValueError``).
    """
    if len(image_counts) != len(prompts):
        raise ValueError(f"{len(image_counts)} image counts for {len(prompts)} prompts")
    if any(n < 0 for n in image_counts):
        raise ValueError(f"image counts must not be negative: {list(image_counts)}")
    with_images = tuple(row for row, n in enumerate(image_counts) if n)
    if placeholder_id is None:
        if with_images:
            listed = [(r, image_counts[r], 0) for r in with_images]
            return Failure(
                _rows_error(
                    MediaErrorKind.TEXT_ONLY_MODEL,
                    "the model takes no images (it has no image placeholder id), "
                    "but rows carry images",
                    listed,
                    "row {row} ({images} images)",
                )
            )
        return Success(with_images)
    counts = [
        (row, n, prompt.count(placeholder_id))
        for row, (prompt, n) in enumerate(zip(prompts, image_counts, strict=True))
    ]
    if max_images is not None:
        over = [c for c in counts if c[1] > max_images]
        if over:
            return Failure(
                _rows_error(
                    MediaErrorKind.IMAGE_LIMIT,
                    f"rows carry more images than the engine takes per prompt "
                    f"(limit_mm_per_prompt image={max_images})",
                    over,
                    "row {row} ({images} images)",
                )
            )
    expanded = [c for c in counts if c[2] > c[1] and _adjacent(prompts[c[0]], placeholder_id)]
    if expanded:
        return Failure(
            _rows_error(
                MediaErrorKind.EXPANDED,
                f"rows look already expanded (adjacent placeholder ids {placeholder_id}, more "
                "than their images): pass one placeholder id per image, vLLM expands it",
                expanded,
                "row {row} ({placeholders} placeholders, {images} images)",
            )
        )
    extra = [c for c in counts if c[1] > c[2]]
    if extra:
        return Failure(
            _rows_error(
                MediaErrorKind.EXTRA_IMAGES,
                f"rows carry more images than placeholder ids {placeholder_id} (one "
                "placeholder per image)",
                extra,
                "row {row} ({images} images, {placeholders} placeholders)",
            )
        )
    missing = [c for c in counts if c[2] > c[1]]
    if missing:
        return Failure(
            _rows_error(
                MediaErrorKind.MISSING_IMAGES,
                f"rows hold more placeholder ids {placeholder_id} than images (vLLM would "
                "leave the extra ones as text)",
                missing,
                "row {row} ({placeholders} placeholders, {images} images)",
            )
        )
    return Success(with_images)


def check_context(
    lengths: Sequence[int], expanded: Sequence[int], max_model_len: int
) -> Result[None, ContextError]:
    """Refuse rows whose expanded prompt leaves no room to generate under ``max_model_len``.

    ``lengths`` are the caller's prompt lengths, ``expanded`` what the context holds (both
    per row). An expansion shorter than the prompt is a programming error (``ValueError``).
    """
    if len(lengths) != len(expanded):
        raise ValueError(f"{len(expanded)} expanded lengths for {len(lengths)} prompts")
    pairs = list(enumerate(zip(lengths, expanded, strict=True)))
    shrunk = [r for r, (n, e) in pairs if e < n]
    if shrunk:
        raise ValueError(f"rows {shrunk} have expanded lengths below their prompt lengths")
    full = [(r, n, e) for r, (n, e) in pairs if e >= max_model_len]
    if not full:
        return Success(None)
    detail = ", ".join(f"row {r} (length {n}, expanded {e})" for r, n, e in full)
    return Failure(
        ContextError(
            f"expanded prompts leave no room to generate under max_model_len {max_model_len}: "
            f"{detail}",
            rows=tuple(r for r, _, _ in full),
            lengths=tuple(n for _, n, _ in full),
            expanded=tuple(e for _, _, e in full),
            max_model_len=max_model_len,
        )
    )


def check_text_room(
    call: str, lengths: Mapping[int, int], max_model_len: int
) -> Result[None, CoreError]:
    """Refuse rows whose prompt text (NeMo-RL's ``vllm_content``), tokenized to
    ``lengths[row]`` ids, leaves no room to generate under ``max_model_len``; the rows are
    named in ``lengths``' order."""
    too_long = [row for row, length in lengths.items() if length >= max_model_len]
    if not too_long:
        return Success(None)
    return Failure(
        CoreError(
            f"{call}: vllm_content of rows {too_long} leaves no room to generate: "
            f"{[lengths[row] for row in too_long]} tokens, max_model_len={max_model_len}"
        )
    )


@attrs.frozen
class UnreadExpansion(CoreError):
    """vLLM rendered row ``row``'s media prompt as no list of ids at least as long as the
    prompt (an engine contract error)."""

    row: int


def expanded_length(row: int, length: int, rendered: object) -> Result[int, UnreadExpansion]:
    """How many ids row ``row``'s prompt of ``length`` ids holds once vLLM's processor
    expanded its images' placeholders (``rendered``: the ``prompt_token_ids`` it
    rendered), for :func:`check_context`."""
    if not isinstance(rendered, list) or len(rendered) < length:
        return Failure(
            UnreadExpansion(
                f"multi_modal_data[{row}]: vLLM rendered {length} prompt ids as {rendered!r:.200}",
                row=row,
            )
        )
    return Success(len(rendered))


@attrs.frozen
class MediaLayoutError(CoreError):
    """The batch's images are not laid out as the module docstring says; ``key`` names the
    data key."""

    key: str


@attrs.frozen
class RawMedia:
    """One row's images as the batch gave them (not yet decoded), the name of their list
    in messages (image ``i`` is ``f"{where}[{i}]"``), and the row's prompt text (NeMo-RL's
    ``vllm_content``; None: its ids)."""

    images: tuple[object, ...]
    where: str
    text: str | None = None


def _carries(value: object) -> bool:
    """Whether a NeMo-RL side channel holds anything (a non-empty entry in some row)."""
    if value is None:
        return False
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return True
    return any(v is not None and not (isinstance(v, Sequence) and len(v) == 0) for v in value)


class _Refused(Exception):
    """A :class:`MediaLayoutError` on its way out to :func:`media_layout`'s Failure."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.error = MediaLayoutError(message, key=key)


def _rows(data: Mapping[str, object], key: str, batch_size: int, call: str) -> Sequence[object]:
    """``data[key]``, a list with one entry per row."""
    value = data[key]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise _Refused(
            f"{call}: data[{key!r}] must be a list with one entry per row, got "
            f"{type(value).__name__}",
            key,
        )
    if len(value) != batch_size:
        raise _Refused(f"{call}: data[{key!r}] has {len(value)} entries for {batch_size} rows", key)
    return value


def _entry(entry: object, row: int, call: str) -> RawMedia | None:
    """Row ``row`` of ``multi_modal_data``."""
    where = f"{call}: {MEDIA_KEY}[{row}]"
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise _Refused(f"{where} must be None or a mapping, got {type(entry).__name__}", MEDIA_KEY)
    unknown = sorted(str(k) for k in entry if k != "image")
    if unknown:
        raise _Refused(f"{where}: only 'image' is supported, got {unknown}", MEDIA_KEY)
    value = entry.get("image")
    images = tuple(value) if isinstance(value, list | tuple) else (value,)
    return RawMedia(images, f"{where}['image']") if value is not None and images else None


def _nemo_rl_row(images: object, text: object, row: int, call: str) -> RawMedia | None:
    """Row ``row`` of NeMo-RL's ``vllm_images`` and ``vllm_content``."""
    where = f"{call}: vllm_images[{row}]"
    if images is not None and not isinstance(images, list | tuple):
        raise _Refused(
            f"{where} must be a list of PIL images, got {type(images).__name__}", "vllm_images"
        )
    if text is not None and (not isinstance(text, str) or not text):
        raise _Refused(
            f"{call}: vllm_content[{row}] must be None or a non-empty str, got {text!r:.80}",
            "vllm_content",
        )
    return RawMedia(tuple(images), where, text) if images else None  # none: the row's ids


def media_layout(
    data: Mapping[str, object], batch_size: int, call: str, *, texts: bool = True
) -> Result[list[RawMedia | None] | None, MediaLayoutError]:
    """Each row's images (undecoded) from ``data`` (see the module docstring), or ``None``
    when no row has any. ``texts=False``: the call's prompts are text already, and a
    ``vllm_content`` that carries anything is refused."""
    try:
        media = _layout(data, batch_size, call, texts)
    except _Refused as e:
        return Failure(e.error)
    return Success(media if media and any(m is not None for m in media) else None)


def _layout(
    data: Mapping[str, object], batch_size: int, call: str, texts: bool
) -> list[RawMedia | None] | None:
    if other := [k for k in ("vllm_audios", "vllm_videos") if _carries(data.get(k))]:
        raise _Refused(
            f"{call}: data keys {other} carry audio or video, which this worker does not "
            "take (images only)",
            other[0],
        )
    if not texts and _carries(data.get("vllm_content")):
        raise _Refused(
            f"{call}: data['vllm_content'] (NeMo-RL's prompt text) is for generate: "
            "this call's prompts are data['prompts']",
            "vllm_content",
        )
    if _carries(data.get("vllm_images")):
        if _carries(data.get(MEDIA_KEY)):
            raise _Refused(
                f"{call}: images in both data[{MEDIA_KEY!r}] and data['vllm_images'] "
                "(NeMo-RL's side channel): keep one",
                MEDIA_KEY,
            )
        images = _rows(data, "vllm_images", batch_size, call)
        content = data.get("vllm_content")
        prompts: Sequence[object] = [None] * batch_size
        if content is not None:
            prompts = _rows(data, "vllm_content", batch_size, call)
        pairs = enumerate(zip(images, prompts, strict=True))
        return [_nemo_rl_row(i, t, row, call) for row, (i, t) in pairs]
    if data.get(MEDIA_KEY) is None:
        return None
    raw = _rows(data, MEDIA_KEY, batch_size, call)
    return [_entry(entry, row, call) for row, entry in enumerate(raw)]


def check_media_by_info(
    prompts: Sequence[Sequence[int]],
    image_counts: Sequence[int],
    info: Mapping[str, object],
    *,
    text_rows: Collection[int] = (),
) -> Result[tuple[int, ...], MediaError]:
    """:func:`check_media` against an engine's ``multimodal_info`` (its
    ``image_token_id`` and ``max_images``; anything but an int: none), for a batch checked
    away from the engine. Rows in ``text_rows`` carry their prompt as text (NeMo-RL's
    ``vllm_content``), checked where it is tokenized: their ids hold the caller's
    processor's expansion, so they count here as rows without images."""
    placeholder, limit = info.get("image_token_id"), info.get("max_images")
    return check_media(
        [() if r in text_rows else p for r, p in enumerate(prompts)],
        [0 if r in text_rows else n for r, n in enumerate(image_counts)],
        placeholder_id=placeholder if isinstance(placeholder, int) else None,
        max_images=limit if isinstance(limit, int) else None,
    )
