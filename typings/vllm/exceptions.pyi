# A ValueError in 0.25, a VLLMClientError (not a ValueError) in 0.32.
class VLLMValidationError(Exception):
    parameter: str | None
    value: object
    def __init__(
        self, message: str, *, parameter: str | None = None, value: object = None
    ) -> None: ...
