"""Shared pieces of the refit tests against real CPU engines (importable as
``refit_helpers``): saved weights, greedy tokens, engine start and stop, and a trainer
process that sends saved weights on command."""

from __future__ import annotations

import multiprocessing
import os
import socket
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from safetensors.torch import load_file

from genworker.shell.refit import fake

if TYPE_CHECKING:
    from vllm import LLM

PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 200], [2, 17, 300, 41]]
REFIT_TIMEOUT = 60.0


@attrs.frozen
class Weights:
    """Two saved checkpoints of the tiny model: A (the engines start on it) and B."""

    a: Path
    b: Path
    b_dir: Path


def greedy(llm: LLM) -> list[list[int]]:
    """Greedy tokens of :data:`PROMPTS`, 12 each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@attrs.frozen
class Engine:
    """A CPU engine with the extension, and its greedy tokens on the weights it started on."""

    llm: LLM
    baseline_a: list[list[int]]

    def rpc(self, method: str, *args: object, **kwargs: object) -> object:
        """The one engine worker's answer."""
        (result,) = self.rpc_all(method, *args, **kwargs)
        return result

    def rpc_all(self, method: str, *args: object, **kwargs: object) -> list[object]:
        """Every engine worker's answer, in rank order."""
        return list(self.llm.collective_rpc(method, args=args, kwargs=kwargs or None))

    def tokens(self) -> list[list[int]]:
        self.llm.reset_prefix_cache()  # the worker does this after every refit
        return greedy(self.llm)


def start_engine(model: Path, *, extension: bool, **overrides: object) -> LLM:
    """A CPU engine on ``model`` (``overrides``: more ``vllm.LLM`` keyword arguments)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from engine_fixtures import EXTENSION_CLS, cpu_engine_kwargs
    from vllm import LLM

    kwargs = cpu_engine_kwargs(model)
    kwargs.pop("worker_extension_cls", None)
    if extension:
        kwargs["worker_extension_cls"] = EXTENSION_CLS
    return LLM(**{**kwargs, **overrides})  # type: ignore[arg-type]


def stop_engine(llm: LLM) -> None:
    from genworker.shell.vllm_engine import VllmEngine

    VllmEngine(llm).shutdown()


class Trainer:
    """A trainer process (``fake.run_trainer``) sending saved weights on command."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._commands = ctx.Queue()
        self._results = ctx.Queue()
        self.process: BaseProcess = ctx.Process(
            target=fake.run_trainer, args=(self._commands, self._results), daemon=True
        )
        self.process.start()
        assert self._results.get(timeout=120) == ("ready", None)

    def submit(self, op: str, **command: object) -> None:
        self._commands.put({"op": op, "timeout_s": REFIT_TIMEOUT, **command})

    def result(self) -> fake.Outcome:
        kind, outcome = self._results.get(timeout=120)
        assert kind == "outcome"
        assert isinstance(outcome, fake.Outcome)
        return outcome

    def stop(self) -> None:
        self._commands.put(None)
        self.process.join(30)


def info(path: Path, keep: set[str] | None = None) -> dict[str, list[object]]:
    """The manifest of a saved checkpoint (``keep``: only these names)."""
    return {
        n: [list(t.shape), str(t.dtype).removeprefix("torch.")]
        for n, t in load_file(path).items()
        if keep is None or n in keep
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
