# Narrow stubs: the NCCL calls genworker.shell.nemo_rl_refit makes (NeMo-RL's packed
# broadcasts on CUDA).
import ctypes

import torch

ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p

class ncclUniqueId(ctypes.Structure): ...

class ncclDataTypeEnum:
    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> int: ...

class NCCLLibrary:
    def __init__(self, so_file: str | None = None) -> None: ...
    def ncclCommInitRank(
        self, world_size: int, unique_id: ncclUniqueId, rank: int
    ) -> ncclComm_t: ...
    def ncclBroadcast(
        self,
        sendbuff: buffer_type,
        recvbuff: buffer_type,
        count: int,
        datatype: int,
        root: int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> None: ...
    def ncclCommDestroy(self, comm: ncclComm_t) -> None: ...
    def ncclGetUniqueId(self) -> ncclUniqueId: ...
