"""Weight refit, trainer to engine, through one door (:mod:`.door`): a backend per
family, each module holding both ends of its transport. genworker's own protocol
(:mod:`genworker.core.refit_protocol`): one sender (:class:`RefitSender`: ``.ipc(address)``
over shared memory and ZMQ, ``.collective(ip, port, world_size)`` over NCCL / gloo), the
engine's ports (:class:`IpcReceiver`, :class:`CollectiveReceiver`) driven by
:func:`receive`; NeMo-RL's wire (:mod:`.nemo_rl`), the sparse relay (:mod:`.sparse`), the
shard-to-shard refit (:mod:`.reshard`); errors across processes (:func:`raise_failures`),
and peers for tests (:mod:`.fake`).
"""

from genworker.core.refit_protocol import RefitReport
from genworker.shell.refit.collective import CollectiveGroup, CollectiveReceiver
from genworker.shell.refit.door import register_backend
from genworker.shell.refit.ipc import IpcReceiver
from genworker.shell.refit.memory import device_id
from genworker.shell.refit.receiver import ParameterSink, manifest_of, receive
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
    "register_backend",
]
