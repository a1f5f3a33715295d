"""The tiny Idefics3's ids, prompt and images, shared by the real-engine multimodal tests
(``test_multimodal_engine.py``, ``test_multimodal_async_engine.py``)."""

from __future__ import annotations

from PIL import Image

__all__ = ["BLUE", "BOS", "IMAGE", "MAX_MODEL_LEN", "MAX_NEW", "PAD", "RED", "TEXT"]

BOS, PAD, IMAGE = 0, 2, 4  # the tiny VLM's <s>, <pad>, <image>
MAX_MODEL_LEN = 256
MAX_NEW = 8
TEXT = "<image> Describe the image."
RED = Image.new("RGB", (40, 30), (255, 0, 0))
BLUE = Image.new("RGB", (20, 50), (0, 0, 255))
