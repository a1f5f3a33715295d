from typing import TypedDict

class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
