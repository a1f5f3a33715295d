"""The images of a generate batch: one entry per row, checked and held for the engine.

``data["multi_modal_data"]`` is a list aligned with the rows (of ``input_ids`` for
``generate``, of ``prompts`` for ``generate_text``): ``None`` for a text-only row, or
``{"image": image}`` / ``{"image": [image, ...]}`` with PIL images, one placeholder id per
image in the row's prompt (:mod:`genworker.core.multimodal` checks those counts). Here:

- the shape: a list of the batch's length, each entry ``None`` or a mapping whose only key
  is ``"image"`` (other modalities are refused by name), images being PIL images;
- that each image can be read: PIL opens files lazily, and a truncated or corrupt file
  fails only when vLLM's processor decodes it, with an ``OSError`` from deep inside. Each
  image is decoded here (``Image.load``; PIL keeps the pixels, so vLLM does not decode it
  again) and must have a size;
- NeMo-RL's side channels, the way its processors and collate functions send images
  (``nemo_rl/models/generation/vllm/utils.py``, ``format_prompt_for_vllm_generation``):
  ``vllm_images`` (per row a list of PIL images, empty for a text row) and ``vllm_content``
  (per row the conversation as text, or ``None``). A row with images takes its prompt from
  its ``vllm_content`` when that is a string (:attr:`RowMedia.text`; NeMo-RL's ``input_ids``
  hold its processor's *expanded* image ids, which vLLM cannot take back as a token prompt,
  and NeMo-RL sends vLLM the text for that reason), else from its ids (NeMo-RL's later
  turns: ``vllm_content`` ``None``); a row without images uses its ids whatever its
  ``vllm_content`` says, as NeMo-RL does. ``vllm_audios`` and ``vllm_videos`` carrying
  anything are refused by name (images only), as are ``vllm_images`` together with
  ``multi_modal_data`` (one way in).

Every problem is a :class:`~genworker.shell.errors.BadBatchError` naming the row (and the
image), raised before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from genworker.core.multimodal import check_context, check_media
from genworker.shell.errors import BadBatchError, unwrap

if TYPE_CHECKING:
    from PIL.Image import Image

    from genworker.shell.ports import EngineCapabilities

__all__ = [
    "MEDIA_KEY",
    "RowMedia",
    "context_lengths",
    "engine_prompts",
    "image_counts",
    "media_rows",
    "row_media",
]

MEDIA_KEY = "multi_modal_data"


@attrs.frozen
class RowMedia:
    """One row's images, in placeholder order (decoded, so vLLM can read them), and the
    row's prompt as text where NeMo-RL's ``vllm_content`` gave one: the engine then starts
    from that text's ids instead of the row's ``input_ids``, which stay the output's."""

    images: tuple[Image, ...]
    text: str | None = None

    def vllm_data(self) -> dict[str, object]:
        """The row's ``multi_modal_data`` for vLLM."""
        return {"image": list(self.images)}


def _image(value: object, where: str) -> Image:
    from PIL import Image

    if not isinstance(value, Image.Image):
        raise BadBatchError(f"{where} must be a PIL image, got {type(value).__name__}")
    try:
        value.load()
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error...
        raise BadBatchError(f"{where} cannot be read ({type(e).__name__}: {e})") from e
    if value.width < 1 or value.height < 1:
        raise BadBatchError(f"{where} is empty ({value.width}x{value.height} pixels)")
    return value


def _entry(entry: object, row: int, call: str) -> RowMedia | None:
    where = f"{call}: {MEDIA_KEY}[{row}]"
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise BadBatchError(f"{where} must be None or a mapping, got {type(entry).__name__}")
    unknown = sorted(str(k) for k in entry if k != "image")
    if unknown:
        raise BadBatchError(f"{where}: only 'image' is supported, got {unknown}")
    value = entry.get("image")
    if value is None:
        return None
    values = list(value) if isinstance(value, list | tuple) else [value]
    images = tuple(_image(v, f"{where}['image'][{i}]") for i, v in enumerate(values))
    return RowMedia(images) if images else None


def _carries(value: object) -> bool:
    """Whether a NeMo-RL side channel holds anything (a non-empty entry in some row)."""
    if value is None:
        return False
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        return True
    return any(v is not None and not (isinstance(v, Sequence) and len(v) == 0) for v in value)


def _rows(data: Mapping[str, object], key: str, batch_size: int, call: str) -> Sequence[object]:
    """``data[key]``, a list with one entry per row."""
    value = data[key]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise BadBatchError(
            f"{call}: data[{key!r}] must be a list with one entry per row, got "
            f"{type(value).__name__}"
        )
    if len(value) != batch_size:
        raise BadBatchError(f"{call}: data[{key!r}] has {len(value)} entries for {batch_size} rows")
    return value


def _nemo_rl_row(images: object, text: object, row: int, call: str) -> RowMedia | None:
    """Row ``row`` of NeMo-RL's ``vllm_images`` and ``vllm_content``."""
    where = f"{call}: vllm_images[{row}]"
    if images is not None and not isinstance(images, list | tuple):
        raise BadBatchError(f"{where} must be a list of PIL images, got {type(images).__name__}")
    decoded = tuple(_image(v, f"{where}[{i}]") for i, v in enumerate(images or ()))
    if text is not None and (not isinstance(text, str) or not text):
        raise BadBatchError(
            f"{call}: vllm_content[{row}] must be None or a non-empty str, got {text!r:.80}"
        )
    return RowMedia(decoded, text) if decoded else None  # NeMo-RL: no images, the ids


def row_media(
    data: Mapping[str, object], batch_size: int, call: str, *, texts: bool = True
) -> list[RowMedia | None] | None:
    """Each row's media from ``data`` (see the module docstring), or ``None`` when no row
    has any. ``texts=False``: the call's prompts are text already, and a ``vllm_content``
    that carries anything is refused."""
    if other := [k for k in ("vllm_audios", "vllm_videos") if _carries(data.get(k))]:
        raise BadBatchError(
            f"{call}: data keys {other} carry audio or video, which this worker does not "
            "take (images only)"
        )
    if not texts and _carries(data.get("vllm_content")):
        raise BadBatchError(
            f"{call}: data['vllm_content'] (NeMo-RL's prompt text) is for generate: "
            "this call's prompts are data['prompts']"
        )
    if _carries(data.get("vllm_images")):
        if _carries(data.get(MEDIA_KEY)):
            raise BadBatchError(
                f"{call}: images in both data[{MEDIA_KEY!r}] and data['vllm_images'] "
                "(NeMo-RL's side channel): keep one"
            )
        images = _rows(data, "vllm_images", batch_size, call)
        content = data.get("vllm_content")
        prompts = (
            [None] * batch_size
            if content is None
            else _rows(data, "vllm_content", batch_size, call)
        )
        media = [
            _nemo_rl_row(*row, i, call) for i, row in enumerate(zip(images, prompts, strict=True))
        ]
    elif data.get(MEDIA_KEY) is None:
        return None
    else:
        raw = _rows(data, MEDIA_KEY, batch_size, call)
        media = [_entry(entry, row, call) for row, entry in enumerate(raw)]
    return media if any(m is not None for m in media) else None


def image_counts(media: Sequence[RowMedia | None] | None, batch_size: int) -> list[int]:
    """How many images each row carries (all 0 without media)."""
    if media is None:
        return [0] * batch_size
    return [0 if m is None else len(m.images) for m in media]


def engine_prompts(
    prompts: Sequence[Sequence[int]],
    media: Sequence[RowMedia | None] | None,
    tokenize: Callable[[list[str]], list[list[int]]],
    max_model_len: int,
    call: str,
) -> Sequence[Sequence[int]]:
    """What the engine starts each row from: its ids, or the ids ``tokenize`` makes of its
    prompt text (NeMo-RL's ``vllm_content``, :attr:`RowMedia.text`), as ``generate_text``
    tokenizes (one BOS); a text that leaves no room to generate is refused by row."""
    texts = {row: m.text for row, m in enumerate(media or ()) if m and m.text is not None}
    if not texts:
        return prompts
    ids = dict(zip(texts, tokenize(list(texts.values())), strict=True))
    if too_long := [row for row, p in ids.items() if len(p) >= max_model_len]:
        raise BadBatchError(
            f"{call}: vllm_content of rows {too_long} leaves no room to generate: "
            f"{[len(ids[r]) for r in too_long]} tokens, max_model_len={max_model_len}"
        )
    return [ids.get(row, prompt) for row, prompt in enumerate(prompts)]


def context_lengths(
    caps: EngineCapabilities,
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int],
    media: Sequence[RowMedia | None] | None,
    expanded_lengths: Callable[[Sequence[Sequence[int]], Sequence[RowMedia | None]], list[int]],
) -> list[int]:
    """What each prompt holds in the context: its length, or for a media row the length
    the engine expands it to (``expanded_lengths``), once core checked the images against
    the placeholders (every row's, a placeholder id without images included) and the
    expanded prompts against ``max_model_len``."""
    if media is None and caps.image_token_id is None:
        return list(lengths)
    unwrap(
        check_media(
            prompts,
            image_counts(media, len(prompts)),
            placeholder_id=caps.image_token_id,
            max_images=caps.max_images,
        ),
        BadBatchError,
        "multi_modal_data",
    )
    if media is None:
        return list(lengths)
    expanded = expanded_lengths(prompts, media)
    unwrap(check_context(lengths, expanded, caps.max_model_len), BadBatchError, "multi_modal_data")
    return expanded


def media_rows(
    caps: EngineCapabilities,
    batch_size: int,
    prompts: Mapping[int, Sequence[int]],
    media: Sequence[RowMedia | None] | None,
    tokenize: Callable[[list[str]], list[list[int]]],
    expanded_lengths: Callable[[Sequence[Sequence[int]], Sequence[RowMedia | None]], list[int]],
    call: str,
) -> tuple[dict[int, Sequence[int]], dict[int, int], dict[int, RowMedia]]:
    """For the rows in ``prompts`` (by batch row; the others were refused): each one's
    engine prompt (:func:`engine_prompts`), what it holds in the context
    (:func:`context_lengths`), and the images of the rows that have some. A bad image
    refuses the batch, rows named as in it."""
    if media is None and caps.image_token_id is None:
        return dict(prompts), {row: len(p) for row, p in prompts.items()}, {}
    rows = [prompts.get(row, ()) for row in range(batch_size)]  # a refused row: empty
    kept = None if media is None else [m if r in prompts else None for r, m in enumerate(media)]
    starts = engine_prompts(rows, kept, tokenize, caps.max_model_len, call)
    lengths = context_lengths(caps, starts, [len(p) for p in starts], kept, expanded_lengths)
    images = {row: m for row, m in enumerate(kept or ()) if m is not None}
    return (
        {row: starts[row] for row in prompts},
        {row: lengths[row] for row in prompts},
        images,
    )
