"""Where the sparse-delta refit was (:mod:`genworker.shell.refit.sparse` now); the name
the workers import from here. Kept for one release."""

from genworker.shell.refit.sparse import SparseRefitError

__all__ = ["SparseRefitError"]
