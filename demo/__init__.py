"""``genworker demo`` and the tiny models the tests, the benchmarks and the demo load.

Not part of the runtime (``genworker.core`` / ``genworker.shell``): a small RL loop around
the worker (generate, score, train, refit; ``rl``), the task it learns (``task``), the
chart and summary it leaves (``chart``, ``report``; matplotlib, the ``demo`` extra) and
the tiny-model builders (``tiny_model``). Importing the package loads none of the
submodules.
"""
