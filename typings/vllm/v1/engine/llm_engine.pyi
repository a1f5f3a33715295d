from vllm.config import VllmConfig
from vllm.v1.engine.output_processor import OutputProcessor

class LLMEngine:
    vllm_config: VllmConfig
    log_stats: bool
    output_processor: OutputProcessor
    def has_unfinished_requests(self) -> bool: ...
    def abort_request(self, request_ids: list[str], internal: bool = False) -> None: ...
    def reset_encoder_cache(self) -> None: ...
