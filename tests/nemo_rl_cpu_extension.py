"""genworker's worker extension with the CPU stand-in codec of NeMo-RL's IPC wire
(``nemo_rl_trainer.CpuShmCodec``) installed on import, for an engine core in a process of
its own (``AsyncLLM`` spawns one), which a test's monkeypatch of
``genworker.shell.refit.nemo_rl.CODECS`` does not reach. vLLM imports it there by its
qualified name, ``nemo_rl_cpu_extension.CpuCodecExtension`` (the tests folder is on the
child's ``sys.path``); a test process must not import it (the codec would stay installed).
"""

from __future__ import annotations

from nemo_rl_trainer import CpuShmCodec

from genworker.shell.extension import WorkerExtension
from genworker.shell.refit.nemo_rl import CODECS

CODECS["cpu"] = CpuShmCodec()


class CpuCodecExtension(WorkerExtension):
    """:class:`WorkerExtension`, from the module that installed the CPU codec."""
