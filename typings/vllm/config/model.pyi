class ModelConfig:
    max_model_len: int
    enable_sleep_mode: bool
    def get_vocab_size(self) -> int: ...
