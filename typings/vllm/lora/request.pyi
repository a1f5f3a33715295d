class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None
    load_inplace: bool
    is_3d_lora_weight: bool
    def __init__(
        self,
        lora_name: str,
        lora_int_id: int,
        lora_path: str = "",
        base_model_name: str | None = None,
        load_inplace: bool = False,
        is_3d_lora_weight: bool = False,
    ) -> None: ...
    @property
    def adapter_id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
