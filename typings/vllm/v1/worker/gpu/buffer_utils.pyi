from collections.abc import Sequence

import torch

# The V2 GPU model runner's staged writes (genworker.shell.staged_writes drops them).
class StagedWriteTensor:
    _staged_write_indices: list[int]
    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        max_concurrency: int | None = None,
        uva_instead_of_gpu: bool = False,
    ) -> None: ...
    def clear_staged_writes(self) -> None: ...
