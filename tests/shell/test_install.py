"""The torchvision guard at engine import (``genworker.shell.install``), over a stand-in
torchvision that fails to load as the default index's CUDA build does beside a CPU torch.
The real mismatched build is met in ``test_wheel_install.py``'s fresh venv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from genworker.shell.errors import GenworkerError
from genworker.shell.install import InstallError, check_torchvision

NMS = "operator torchvision::nms does not exist"


def _fake_torchvision(root: Path, body: str) -> None:
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text(body)
    info = root / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")


@pytest.fixture
def fresh_torchvision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    return tmp_path


def test_a_torchvision_that_cannot_load_is_refused_with_the_command(
    fresh_torchvision: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_torchvision(fresh_torchvision, f"raise RuntimeError({NMS!r})\n")
    monkeypatch.setattr(
        "importlib.metadata.version", lambda name: {"torch": "2.13.0+cpu"}.get(name, "0.28.0")
    )
    with pytest.raises(InstallError) as caught:
        check_torchvision()
    message = str(caught.value)
    assert "torchvision 0.28.0 cannot load beside torch 2.13.0+cpu" in message
    assert NMS in message
    assert (
        "pip install --force-reinstall --no-deps 'torchvision==0.28.0+cpu' "
        "--index-url https://download.pytorch.org/whl/cpu"
    ) in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value, GenworkerError)
    assert isinstance(caught.value, ImportError)


def test_a_torchvision_that_loads_passes(fresh_torchvision: Path) -> None:
    _fake_torchvision(fresh_torchvision, "LOADED = True\n")
    check_torchvision()
    assert sys.modules["torchvision"].LOADED is True


def test_no_torchvision_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    check_torchvision()
