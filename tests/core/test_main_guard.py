"""``genworker.core.main_guard``: which ``__main__`` modules vLLM's spawned engine core
runs again, and whether the statement running lies inside the ``__main__`` guard."""

from __future__ import annotations

import pytest

from genworker.core.main_guard import guarded_line, reruns_on_spawn


@pytest.mark.parametrize(
    ("source", "line", "expected"),
    [
        ('if __name__ == "__main__":\n    run()\n', 2, True),
        ("if '__main__' == __name__:\n    x = 1\n    run()\n", 3, True),
        ("run()\n", 1, False),
        ("import os\n\nif os.environ:\n    run()\n", 4, False),
        ('if __name__ != "__main__":\n    run()\n', 2, False),
        ('if __name__ == "__main__" and True:\n    run()\n', 2, False),
        ("x = (1,\n     2)\n", 2, False),
        ("run()\n\n\n", 3, None),
        ("def f(:\n", 1, None),
    ],
)
def test_the_statement_running_is_guarded_only_inside_the_main_test(
    source: str, line: int, expected: bool | None
) -> None:
    assert guarded_line(source, line) is expected


@pytest.mark.parametrize(
    ("spec_name", "main_file", "expected"),
    [
        (None, "/work/train.py", True),  # python train.py
        ("trainer.run", "/work/trainer/run.py", True),  # python -m trainer.run
        ("trainer.__main__", "/work/trainer/__main__.py", False),  # python -m trainer
        ("__main__", None, False),
        (None, None, False),  # python -c, an interactive session
        (None, "/usr/bin/ipython", False),  # multiprocessing skips IPython's launcher
    ],
)
def test_which_main_modules_a_spawned_child_runs_again(
    spec_name: str | None, main_file: str | None, expected: bool
) -> None:
    assert reruns_on_spawn(spec_name, main_file) is expected
