"""Where NeMo-RL's wire receivers were (:mod:`genworker.shell.refit.nemo_rl` now); the
name the drop-ins import from here. Kept for one release."""

from genworker.shell.refit.nemo_rl import DEFAULT_SOCKET_DIR

__all__ = ["DEFAULT_SOCKET_DIR"]
