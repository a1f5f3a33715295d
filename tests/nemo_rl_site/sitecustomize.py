"""The NeMo-RL integration test's own environment (``test_nemo_rl_integration``): Python
loads this ``sitecustomize`` at start-up in every process of that test (the driver, Ray's
workers, vLLM's engine core), because the test puts this folder first on ``PYTHONPATH``.
The test itself reads :data:`STUBS` from it with the switch off; nothing else imports it.

It does four things, only when switched on by ``GENWORKER_NEMO_RL_SITE=1``:

1. **NeMo-RL's transformers check**: ``nemo_rl/models/policy/__init__.py`` (7ea279ab)
   asserts ``transformers < 5.12`` before patching a deepseek_v3 tokenizer registry;
   vLLM 0.32 needs transformers >= 5.16.1. The module is loaded from NeMo-RL's own source
   with that one ``assert`` statement left out (found by what it compares; anything else
   in the file runs as written). If the statement is not found exactly once the import
   fails, naming the file: a NeMo-RL that changed the check is not silently run.
2. **Python 3.13's TypedDict for NeMo-RL**: NeMo-RL needs Python 3.13; this venv has 3.11,
   whose ``typing.TypedDict`` pydantic refuses in NeMo-RL's config models. NeMo-RL's own
   modules (and only while they execute) see ``typing_extensions.TypedDict``, the
   ``TypedDict`` of Python >= 3.12.
3. **Stubs** for modules unrelated to generation that this venv lacks
   (:data:`STUBS`): importing one gives a module whose every attribute is a class that
   raises :class:`StubUsedError` when called. A stub that is *used* fails the test.
4. **The CPU stand-in for CUDA IPC**: when genworker's NeMo-RL refit module is imported,
   the test's CPU shared-memory handle codec (``nemo_rl_trainer.CpuShmCodec``) is added
   to its ``CODECS`` (NeMo-RL's trainer sends CUDA IPC handles; a CPU has none).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

#: Modules replaced by stubs when this venv cannot import them: loggers and trackers,
#: dataset, data-loading and audio libraries, NVML, the trainer's class loader, which
#: grpo.py and rollouts.py import (directly or through NeMo-RL's other modules) at module
#: level. None of them is on the generation or refit path.
STUBS: tuple[str, ...] = (
    "wandb",
    "mlflow",
    "swanlab",
    "torch.utils.tensorboard",
    "torchdata",
    "datasets",
    "pynvml",
    "tensordict",
    "pandas",
    "absl",
    "scipy",
    "soundfile",
    "hydra",
)

POLICY_MODULE = "nemo_rl.models.policy"


class StubUsedError(RuntimeError):
    """A stubbed module's attribute was used: the scenario reached code unrelated to
    generation, which this test does not provide."""


def _placeholder(qualname: str) -> type:
    def refuse(*args: object, **kwargs: object) -> Any:
        raise StubUsedError(f"{qualname} is a stub of genworker's NeMo-RL integration test")

    return type(qualname.rsplit(".", 1)[-1], (), {"__new__": refuse, "__module__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: submodules are stubs too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _PolicyLoader(importlib.machinery.SourceFileLoader):
    """NeMo-RL's policy package with its transformers assertion left out."""

    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        tree = ast.parse(data, filename=str(path))
        removed = 0
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            kept = [s for s in body if not _is_the_version_check(s)]
            removed += len(body) - len(kept)
            node.body = kept  # type: ignore[attr-defined]
        if removed != 1:
            raise ImportError(
                f"{path}: expected NeMo-RL's one `assert transformers < 5.12` statement, "
                f"found {removed}; update tests/nemo_rl_site/sitecustomize.py",
                name=POLICY_MODULE,
            )
        return compile(tree, str(path), "exec", dont_inherit=True)


def _is_the_version_check(statement: ast.stmt) -> bool:
    if not isinstance(statement, ast.Assert):
        return False
    text = ast.unparse(statement.test)
    return "transformers.__version__" in text and "'5.12.0'" in text


def _installed(name: str) -> bool:
    """Whether the real module imports (a stub stands in only for what is missing)."""
    finders = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    saved = sys.meta_path[:]
    sys.meta_path[:] = finders
    try:
        importlib.import_module(name)
    except ImportError:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        return False
    finally:
        sys.meta_path[:] = saved
    return True


class _TypedDictsAsOnPython313(importlib.abc.Loader):
    """Runs a NeMo-RL module with ``typing.TypedDict`` as Python >= 3.12 has it
    (``typing_extensions.TypedDict``): NeMo-RL needs Python 3.13, this venv has 3.11, whose
    ``typing.TypedDict`` pydantic refuses in NeMo-RL's config models. Only while NeMo-RL's
    own modules execute."""

    depth = 0

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        import typing

        import typing_extensions

        cls = type(self)
        saved = typing.TypedDict
        cls.depth += 1
        setattr(typing, "TypedDict", typing_extensions.TypedDict)  # noqa: B010
        try:
            self.real.exec_module(module)
        finally:
            cls.depth -= 1
            if cls.depth == 0:
                setattr(typing, "TypedDict", saved)  # noqa: B010


def _nemo_rl_spec(
    fullname: str, path: Sequence[str] | None
) -> importlib.machinery.ModuleSpec | None:
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None or spec.origin is None:
        return spec
    if fullname == POLICY_MODULE:
        spec.loader = _PolicyLoader(fullname, spec.origin)
    spec.loader = _TypedDictsAsOnPython313(spec.loader)
    return spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "nemo_rl" or fullname.startswith("nemo_rl."):
            return _nemo_rl_spec(fullname, path)
        if fullname in STUBS:
            if _installed(fullname):
                return None  # the real module imports: no stub
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        parent = fullname.rpartition(".")[0]
        if isinstance(sys.modules.get(parent), _StubModule):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def _cpu_codec(module: types.ModuleType) -> None:
    from nemo_rl_trainer import CpuShmCodec

    module.CODECS["cpu"] = CpuShmCodec()


#: What runs right after a module has loaded (a module already loaded is patched at once).
AFTER_IMPORT = {
    "genworker.shell.refit.nemo_rl": _cpu_codec,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :data:`AFTER_IMPORT`'s function once its module has loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        found = AFTER_IMPORT.get(fullname)
        if found is None:
            return None
        then: Callable[[types.ModuleType], None] = found
        spec = next(
            (
                s
                for f in sys.meta_path
                if f is not self and (s := f.find_spec(fullname, path, target)) is not None
            ),
            None,
        )
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return real.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                real.exec_module(module)
                then(module)

        spec.loader = Loader()
        return spec


if os.environ.get("GENWORKER_NEMO_RL_SITE") == "1":
    sys.meta_path.insert(0, _Finder())
    sys.meta_path.insert(0, _AfterImport())
    for name, patch in AFTER_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
