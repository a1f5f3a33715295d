"""The images of a generate batch: one entry per row, checked and held for the engine.

Where the images are (``data["multi_modal_data"]``, or NeMo-RL's ``vllm_images`` and
``vllm_content`` side channels) is core's to read (:func:`genworker.core.multimodal.media_layout`,
whose docstring has the rules). Here each image is decoded: PIL opens files lazily, and a
truncated or corrupt file fails only when vLLM's processor decodes it, with an ``OSError``
from deep inside. ``Image.load`` decodes it now (PIL keeps the pixels, so vLLM does not
decode it again), and it must have a size. Every problem is a
:class:`~genworker.shell.errors.BadBatchError` naming the row (and the image), raised
before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from genworker.core.multimodal import check_context, check_media, check_text_room, media_layout
from genworker.shell.errors import BadBatchError, unwrap

if TYPE_CHECKING:
    from PIL.Image import Image

    from genworker.shell.ports import EngineCapabilities

__all__ = [
    "RowMedia",
    "image_counts",
    "media_rows",
    "row_media",
]


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


def row_media(
    data: Mapping[str, object], batch_size: int, call: str, *, texts: bool = True
) -> list[RowMedia | None] | None:
    """Each row's media from ``data`` (``core.multimodal.media_layout``), its images
    decoded, or ``None`` when no row has any. ``texts=False``: the call's prompts are text
    already, and a ``vllm_content`` that carries anything is refused."""
    layout = unwrap(media_layout(data, batch_size, call, texts=texts), BadBatchError, "")
    if layout is None:
        return None
    return [
        None
        if raw is None
        else RowMedia(
            tuple(_image(v, f"{raw.where}[{i}]") for i, v in enumerate(raw.images)), raw.text
        )
        for raw in layout
    ]


def image_counts(media: Sequence[RowMedia | None] | None, batch_size: int) -> list[int]:
    """How many images each row carries (all 0 without media)."""
    if media is None:
        return [0] * batch_size
    return [0 if m is None else len(m.images) for m in media]


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
    engine prompt, what it holds in the context, and the images of the rows that have some.

    The engine starts a row from its ids, or from the ids ``tokenize`` makes of its prompt
    text (NeMo-RL's ``vllm_content``, :attr:`RowMedia.text`), as ``generate_text``
    tokenizes (one BOS); a text that leaves no room to generate is refused by row. A row
    holds its prompt's length in the context, or for a media row the length the engine
    expands it to (``expanded_lengths``), once core checked the images against the
    placeholders (every row's, a placeholder id without images included) and the expanded
    prompts against ``max_model_len``. A bad image refuses the batch, rows named as in it."""
    if media is None and caps.image_token_id is None:
        return dict(prompts), {row: len(p) for row, p in prompts.items()}, {}
    starts = [prompts.get(row, ()) for row in range(batch_size)]  # a refused row: empty
    kept = None if media is None else [m if r in prompts else None for r, m in enumerate(media)]
    images = {row: m for row, m in enumerate(kept or ()) if m is not None}
    if texts := {row: m.text for row, m in images.items() if m.text is not None}:
        ids = dict(zip(texts, tokenize(list(texts.values())), strict=True))
        room = check_text_room(call, {row: len(p) for row, p in ids.items()}, caps.max_model_len)
        unwrap(room, BadBatchError, "")
        starts = [ids.get(row, prompt) for row, prompt in enumerate(starts)]
    lengths = [len(p) for p in starts]
    unwrap(
        check_media(
            starts,
            image_counts(kept, batch_size),
            placeholder_id=caps.image_token_id,
            max_images=caps.max_images,
        ),
        BadBatchError,
        "multi_modal_data",
    )
    if kept is not None:
        expanded = expanded_lengths(starts, kept)
        unwrap(
            check_context(lengths, expanded, caps.max_model_len), BadBatchError, "multi_modal_data"
        )
        lengths = expanded
    return (
        {row: starts[row] for row in prompts},
        {row: lengths[row] for row in prompts},
        images,
    )
