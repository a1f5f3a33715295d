from dataclasses import Field
from typing import Any, ClassVar

class EngineArgs:
    # A dataclass: genworker reads only its field names (dataclasses.fields).
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

class AsyncEngineArgs(EngineArgs):
    # The keyword arguments are EngineArgs fields (see the allowlist).
    def __init__(self, **kwargs: object) -> None: ...
