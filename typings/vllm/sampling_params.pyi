from enum import Enum
from typing import Any

class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

class SamplingParams:
    def __init__(
        self,
        *,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        seed: int | None = ...,
        stop: str | list[str] | None = ...,
        stop_token_ids: list[int] | None = ...,
        ignore_eos: bool = ...,
        max_tokens: int | None = ...,
        logprobs: int | None = ...,
        prompt_logprobs: int | None = ...,
        flat_logprobs: bool = ...,
        include_stop_str_in_output: bool = ...,
        bad_words: list[str] | None = ...,
        output_kind: RequestOutputKind = ...,
        extra_args: dict[str, Any] | None = ...,
        n: int = ...,
        detokenize: bool = ...,
    ) -> None: ...
    extra_args: dict[str, Any] | None
    n: int
    def clone(self) -> SamplingParams: ...
