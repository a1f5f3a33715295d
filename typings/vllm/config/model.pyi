class ModelConfig:
    max_model_len: int
    enable_sleep_mode: bool
    skip_tokenizer_init: bool
    def get_vocab_size(self) -> int: ...
