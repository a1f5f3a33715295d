"""The NeMo-RL integration test's environment (``tests/nemo_rl_site/sitecustomize.py``) on a
package laid out as NeMo-RL's, without NeMo-RL: it leaves out exactly NeMo-RL's transformers
assertion and refuses a file where that statement is not found once, NeMo-RL's modules see
Python 3.12's ``TypedDict`` only while they execute, a stub raises when used, and nothing
happens with the switch off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent.parent / "nemo_rl_site"

CHECK = (
    "def _patch():\n"
    "    import transformers\n"
    "    from packaging.version import Version as PkgVersion\n"
    "    assert PkgVersion(transformers.__version__) < PkgVersion('5.12.0'), 'too new'\n"
    "    PATCHED.append(True)\n"
    "PATCHED = []\n"
    "_patch()\n"
)


def _nemo_rl(root: Path, policy: str) -> None:
    """``nemo_rl/models/policy/__init__.py`` holding ``policy``, and a TypedDict module."""
    pkg = root / "nemo_rl"
    (pkg / "models" / "policy").mkdir(parents=True)
    for d in (pkg, pkg / "models"):
        (d / "__init__.py").write_text("")
    (pkg / "models" / "policy" / "__init__.py").write_text(policy)
    (pkg / "config.py").write_text(
        "import typing\nfrom typing import TypedDict\n"
        "class Config(TypedDict):\n    a: int\n"
        "SEEN = TypedDict\n"
    )


def _run(root: Path, code: str, *, switch: str = "1") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GENWORKER_NEMO_RL_SITE": switch,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(root)]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_only_nemo_rls_transformers_assertion_is_left_out(tmp_path: Path) -> None:
    _nemo_rl(tmp_path, CHECK)
    code = (
        "import transformers, typing, typing_extensions\n"
        "transformers.__version__ = '5.19.0'\n"
        "import nemo_rl.models.policy as p, nemo_rl.config as c\n"
        "print(p.PATCHED, c.SEEN is typing_extensions.TypedDict,"
        " typing.TypedDict is typing_extensions.TypedDict)\n"
    )
    done = _run(tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[True]", "True", "False"]
    off = _run(tmp_path, code, switch="0")
    assert "AssertionError: too new" in off.stderr


@pytest.mark.parametrize("times", [0, 2])
def test_a_policy_file_without_exactly_one_such_assertion_is_refused(
    tmp_path: Path, times: int
) -> None:
    line = "assert PkgVersion(transformers.__version__) < PkgVersion('5.12.0')\n"
    body = "import transformers\nfrom packaging.version import Version as PkgVersion\n"
    _nemo_rl(tmp_path, body + line * times)
    done = _run(tmp_path, "import nemo_rl.models.policy")
    assert done.returncode != 0
    assert f"found {times}" in done.stderr
    assert "policy/__init__.py" in done.stderr


def test_a_stub_stands_in_for_a_missing_module_and_raises_when_used(tmp_path: Path) -> None:
    code = (
        "import sitecustomize as s\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        "import wandb\n"
        "class Mine(wandb.Table): pass\n"
        "try:\n    StatefulDataLoader([])\n"
        "except s.StubUsedError as e:\n    print(e)\n"
    )
    done = _run(tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchdata.stateful_dataloader.StatefulDataLoader is a stub" in done.stdout
    off = _run(tmp_path, "import torchdata", switch="0")
    assert "No module named 'torchdata'" in off.stderr


def test_a_listed_module_that_is_installed_is_not_stubbed(tmp_path: Path) -> None:
    code = (
        "import sitecustomize as s\n"
        "s.STUBS = (*s.STUBS, 'numpy', 'no_such_module_here')\n"
        "import numpy, no_such_module_here\n"
        "print(type(numpy).__name__, type(no_such_module_here).__name__)\n"
    )
    done = _run(tmp_path, code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["module", "_StubModule"]
