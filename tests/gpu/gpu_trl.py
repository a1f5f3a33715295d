"""What the RL-routes GPU test runs in its spawned trainer process (imported as
``gpu.gpu_trl``): TRL's own server-mode client on the child's one GPU."""

from __future__ import annotations

import os
from pathlib import Path

from gpu.gpu_fixtures import load_checkpoint


def trl_trainer_main(url: str, checkpoint: str, port: int) -> dict[str, object]:
    """Join the server's weight-transfer group with TRL's ``VLLMClient`` and send
    ``checkpoint`` as TRL's ``update_named_params`` does (start, update, finish)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=url, group_port=port, connection_timeout=60)
    client.init_communicator(device=0)
    tensors = load_checkpoint(Path(checkpoint), "cuda")
    metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    client.update_named_params(metadata, iter(tensors.items()))
    client.close_communicator()  # type: ignore[no-untyped-call]
    return {"world_size": client.get_world_size(), "tensors": len(tensors)}
