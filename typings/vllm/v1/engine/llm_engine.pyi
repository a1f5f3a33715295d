from vllm.config import VllmConfig

class LLMEngine:
    vllm_config: VllmConfig
    log_stats: bool
    def reset_encoder_cache(self) -> None: ...
