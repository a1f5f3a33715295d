"""Weight refit, trainer to engine: senders, receivers and their two transports.

- :mod:`~genworker.shell.refit.ipc`: shared buffers (CUDA IPC / shared memory) with ZMQ
  REQ/REP metadata, for a trainer on the engine's host.
- :mod:`~genworker.shell.refit.collective`: a standalone NCCL (CUDA) or gloo (CPU) group.
- :mod:`~genworker.shell.refit.session`: the transport-independent receiving side.
- :mod:`~genworker.shell.refit.direct`: the fast paths (no staging buckets) both
  transports choose automatically when every tensor goes straight into a parameter.
- :mod:`~genworker.shell.refit.arena`: a trainer-side allocation holding every tensor of a
  refit, so a direct IPC refit maps one handle instead of one per tensor.
- :mod:`~genworker.shell.refit.fake`: peers for tests (a dict-of-tensors receiver, a
  scripted sender).

Both transports pack with :mod:`genworker.core.refit_plan` and speak the messages of
:mod:`~genworker.shell.refit.wire`; the engine side is ``genworker.shell.extension``.
"""

from genworker.shell.refit.arena import RefitArena
from genworker.shell.refit.buffers import device_id
from genworker.shell.refit.collective import CollectiveGroup, CollectiveReceiver, CollectiveSender
from genworker.shell.refit.ipc import IpcReceiver, IpcSender
from genworker.shell.refit.packing import DEFAULT_BUCKET_BYTES, SendReport
from genworker.shell.refit.session import (
    ParameterSink,
    ReceiverTransport,
    ReceiveSession,
    RefitReport,
    RefitSink,
    manifest_of,
    receive_refit,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "CollectiveGroup",
    "CollectiveReceiver",
    "CollectiveSender",
    "IpcReceiver",
    "IpcSender",
    "ParameterSink",
    "ReceiveSession",
    "ReceiverTransport",
    "RefitArena",
    "RefitReport",
    "RefitSink",
    "SendReport",
    "device_id",
    "manifest_of",
    "receive_refit",
]
