from collections.abc import Mapping
from typing import NotRequired, TypedDict

class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Mapping[str, object] | None]

class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Mapping[str, object] | None]
