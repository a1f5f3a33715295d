import argparse
from typing import Any

class FlexibleArgumentParser(argparse.ArgumentParser):
    # vLLM's parser of `vllm serve` (dashes or underscores, JSON options); genworker's CLI
    # parses vLLM's engine options with it.
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
