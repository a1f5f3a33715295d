class SpeculativeConfig:
    # Resolved by vLLM at engine start (inferred from the drafter when not given).
    num_speculative_tokens: int
