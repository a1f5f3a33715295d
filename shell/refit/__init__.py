"""Weight refit, trainer to engine: one protocol (``genworker.core.refit_protocol``), one
sender, two transports that only move bytes.

- :class:`RefitSender`: the trainer's end, ``RefitSender.ipc(address)`` (shared memory:
  CUDA IPC or shared-memory files, with ZMQ messages; :mod:`.ipc`) or
  ``RefitSender.collective(ip, port, world_size)`` (a standalone NCCL / gloo group;
  :mod:`.collective`); ``send(named_tensors)`` per refit.
- the engine's end is ``genworker.shell.extension.WorkerExtension``, over
  :func:`receive` (:mod:`.receiver`) and the ports :class:`IpcReceiver` and
  :class:`CollectiveReceiver`.
- :mod:`.memory`: staging buffers, handles, mappings kept across refits; :mod:`.wire`:
  the msgpack schema and errors across processes (:func:`raise_failures`);
  :mod:`.fake`: peers for tests.
"""

from genworker.shell.refit.collective import CollectiveGroup, CollectiveReceiver
from genworker.shell.refit.ipc import IpcReceiver
from genworker.shell.refit.memory import device_id
from genworker.shell.refit.receiver import ParameterSink, RefitReport, manifest_of, receive
from genworker.shell.refit.sender import RefitSender
from genworker.shell.refit.wire import failure, raise_failures

__all__ = [
    "CollectiveGroup",
    "CollectiveReceiver",
    "IpcReceiver",
    "ParameterSink",
    "RefitReport",
    "RefitSender",
    "device_id",
    "failure",
    "manifest_of",
    "raise_failures",
    "receive",
]
