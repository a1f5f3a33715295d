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
- NeMo-RL's own multimodal batch keys (``vllm_content``, ``vllm_images``, ``vllm_audios``,
  ``vllm_videos``) are refused by name when any row carries something in them (NeMo-RL
  itself ignores rows whose entries are empty): NeMo-RL reads them only together with
  ``vllm_content`` (a text prompt used instead of the token ids), which breaks the output
  contract's "the caller's own ids"; ``multi_modal_data`` is the way in.

Every problem is a :class:`~genworker.shell.errors.BadBatchError` naming the row (and the
image), raised before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from genworker.shell.errors import BadBatchError

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["MEDIA_KEY", "NEMO_RL_MEDIA_KEYS", "RowMedia", "image_counts", "row_media"]

MEDIA_KEY = "multi_modal_data"
NEMO_RL_MEDIA_KEYS = ("vllm_content", "vllm_images", "vllm_audios", "vllm_videos")


@attrs.frozen
class RowMedia:
    """One row's images, in placeholder order (decoded, so vLLM can read them)."""

    images: tuple[Image, ...]

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


def row_media(
    data: Mapping[str, object], batch_size: int, call: str
) -> list[RowMedia | None] | None:
    """Each row's media from ``data`` (see the module docstring), or ``None`` when no row
    has any."""
    nemo = [key for key in NEMO_RL_MEDIA_KEYS if _carries(data.get(key))]
    if nemo:
        raise BadBatchError(
            f"{call}: data keys {nemo} are NeMo-RL's multimodal side channels, which this "
            f"worker does not read; pass data[{MEDIA_KEY!r}] (per row: None or "
            "{'image': PIL image or list}) with one placeholder id per image in the prompt"
        )
    raw = data.get(MEDIA_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise BadBatchError(
            f"{call}: data[{MEDIA_KEY!r}] must be a list with one entry per row, got "
            f"{type(raw).__name__}"
        )
    if len(raw) != batch_size:
        raise BadBatchError(
            f"{call}: data[{MEDIA_KEY!r}] has {len(raw)} entries for {batch_size} rows"
        )
    media = [_entry(entry, row, call) for row, entry in enumerate(raw)]
    return media if any(m is not None for m in media) else None


def image_counts(media: Sequence[RowMedia | None] | None, batch_size: int) -> list[int]:
    """How many images each row carries (all 0 without media)."""
    if media is None:
        return [0] * batch_size
    return [0 if m is None else len(m.images) for m in media]
