from collections.abc import Sequence

from vllm.logprobs import FlatLogprobs, Logprob

class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: FlatLogprobs | list[dict[int, Logprob]] | None
    finish_reason: str | None
    # (prompt + generated - 1, layers, top_k) expert ids with enable_return_routed_experts
    routed_experts: object

class RequestOutput:
    request_id: str
    prompt_token_ids: list[int] | None
    # per prompt position (None at the first), with SamplingParams.prompt_logprobs set
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
