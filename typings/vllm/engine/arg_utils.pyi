from dataclasses import Field
from typing import Any, ClassVar

from vllm.utils.argparse_utils import FlexibleArgumentParser

class EngineArgs:
    # A dataclass: genworker reads only its field names (dataclasses.fields).
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    @staticmethod
    def add_cli_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser: ...

class AsyncEngineArgs(EngineArgs):
    # The keyword arguments are EngineArgs fields (see the allowlist).
    def __init__(self, **kwargs: object) -> None: ...
    @staticmethod
    def add_cli_args(
        parser: FlexibleArgumentParser, async_args_only: bool = False
    ) -> FlexibleArgumentParser: ...
