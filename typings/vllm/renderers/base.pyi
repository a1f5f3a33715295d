from abc import ABC
from collections.abc import Sequence
from functools import cached_property

from vllm.inputs import TextPrompt, TokensPrompt
from vllm.renderers.params import TokenizeParams

class BaseRenderer(ABC):
    # The runtime class is Generic in its tokenizer type; genworker reads bos_token only.
    def get_tokenizer(self) -> object: ...
    @cached_property
    def default_cmpl_tok_params(self) -> TokenizeParams: ...
    def tokenize_prompts(
        self, prompts: Sequence[TextPrompt | TokensPrompt], params: TokenizeParams
    ) -> list[TokensPrompt]: ...
    # Returns vLLM's engine inputs (TypedDicts): "prompt_token_ids" is read.
    def render_cmpl(
        self,
        prompts: Sequence[TextPrompt | TokensPrompt],
        tok_params: TokenizeParams | None = None,
        *,
        prompt_extras: dict[str, object] | None = None,
        skip_mm_cache: bool = False,
    ) -> list[dict[str, object]]: ...
    async def clear_mm_cache_async(self) -> None: ...
