"""The README and docs/ as a user reads them: every ```python block runs as written.

Each block is one of three kinds, said by a comment line right above it:

- no marker: a CPU program, run as written in a subprocess of its own, in an empty
  temporary directory, with the Makefile's environment (``PYTHONSAFEPATH=1``,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_TARGET_DEVICE=cpu``) and a timeout;
- ``<!-- gpu: why -->``: a program that needs CUDA; run as written where CUDA is, skipped
  with its reason elsewhere;
- ``<!-- fragment: why -->``: part of a program (one process's half of a refit, an
  outline); not run, but it must parse, and it is counted.

docs/nemo-rl.md's config-key table is generated from ``genworker.core.config_keys.KEYS``
(``python tests/shell/test_docs.py --write`` rewrites it), so it cannot drift.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from genworker.core.config_keys import KEYS, Fate, KeyRule

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
#: the Makefile's RUN variables
CPU_ENV = {
    "PYTHONSAFEPATH": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
}
#: seconds one snippet may run (an engine start takes 30-60 s on a busy 2-core host)
TIMEOUT_S = 420
#: snippets that start a real engine cost most of this test's time: keep them few
MAX_ENGINE_SNIPPETS = 3
README_MAX_LINES = 250

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(gpu|fragment):\s*(\S.*?)\s*-->\s*$")
_ANY_MARKER = re.compile(r"^<!--\s*(\w[\w-]*):")
_ENGINE = re.compile(r"\b(VllmGenerationWorker|AsyncVllmGenerationWorker|GenerationGroup)\(")


@attrs.frozen
class Snippet:
    """One ```python block: where it is, its kind (cpu, gpu, fragment) and why."""

    path: Path
    line: int
    kind: str
    reason: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def starts_an_engine(self) -> bool:
        """A CPU block that builds a worker or group on a real engine (no fake factory)."""
        return (
            self.kind == "cpu"
            and bool(_ENGINE.search(self.code))
            and "engine_factory=" not in self.code
        )


def snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of one Markdown file, with the marker above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that never closes")
        if fence.group(1) in ("python", "py"):
            above = lines[i - 1] if i else ""
            marker = _MARKER.match(above)
            if marker is None and _ANY_MARKER.match(above):
                raise ValueError(
                    f"{path}:{i}: unknown snippet marker {above!r} "
                    "(<!-- gpu: why --> or <!-- fragment: why -->)"
                )
            kind, reason = marker.groups() if marker else ("cpu", "")
            found.append(Snippet(path, i + 1, kind, reason, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return found


ALL = [s for path in DOCS for s in snippets(path)]


def test_the_blocks_are_counted_and_few_start_an_engine() -> None:
    kinds = {kind: sum(s.kind == kind for s in ALL) for kind in ("cpu", "gpu", "fragment")}
    print(f"python blocks in README.md and docs/: {kinds}")  # shown with -s / -rA
    assert sum(kinds.values()) == len(ALL)
    assert kinds["cpu"] >= 3, kinds  # the README's loop and the cheap docs examples
    engines = [s.name for s in ALL if s.starts_an_engine]
    assert 1 <= len(engines) <= MAX_ENGINE_SNIPPETS, engines


def test_the_marker_parser_reads_each_kind_and_refuses_an_unknown_marker(
    tmp_path: Path,
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nprint(1)\n```\n"
        "<!-- gpu: needs CUDA -->\n```python\nimport torch\n```\n"
        "<!-- fragment: half a program -->\n```py\nworker.sleep()\n```\n"
        "```bash\nmake test\n```\n"
    )
    assert [(s.line, s.kind, s.reason, s.code) for s in snippets(page)] == [
        (2, "cpu", "", "print(1)\n"),
        (6, "gpu", "needs CUDA", "import torch\n"),
        (10, "fragment", "half a program", "worker.sleep()\n"),
    ]
    page.write_text("<!-- gpux: typo -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="unknown snippet marker"):
        snippets(page)
    page.write_text("```python\nprint(1)\n")
    with pytest.raises(ValueError, match="never closes"):
        snippets(page)


def _run(snippet: Snippet, tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{snippet.name} ran past {TIMEOUT_S} s: {e.stderr!r}"[-4000:])
    assert done.returncode == 0, (
        f"{snippet.name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def _params() -> list[object]:
    return [
        pytest.param(s, id=s.name, marks=[pytest.mark.engine] if s.starts_an_engine else [])
        for s in ALL
    ]


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("snippet", _params())
def test_each_block_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.kind == "fragment":
        assert snippet.reason
        ast.parse(snippet.code, filename=snippet.name)  # a fragment is still Python
        return
    if snippet.kind == "gpu":
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{snippet.name} needs CUDA ({snippet.reason})")
        env = {k: v for k, v in os.environ.items() if k not in CPU_ENV} | {"PYTHONSAFEPATH": "1"}
        _run(snippet, tmp_path, env)
        return
    _run(snippet, tmp_path, os.environ | CPU_ENV)


# -- docs/nemo-rl.md's key table ----------------------------------------------------------

NEMO_RL = REPO / "docs" / "nemo-rl.md"
TABLE_START = "<!-- keys-table: generated from genworker.core.config_keys.KEYS -->"
TABLE_END = "<!-- keys-table end -->"

_FATE_TEXT = {
    Fate.HONOURED: "honoured",
    Fate.INERT: "accepted, no effect",
    Fate.NEMO_RL_SIDE: "accepted (NeMo-RL reads it)",
    Fate.ASYNC_WORKER: "honoured (async worker)",
    Fate.HTTP_SERVER: "honoured (OpenAI server)",
    Fate.REFUSED: "refused",
}


def _value(value: object) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def _row(rule: KeyRule) -> str:
    fate = _FATE_TEXT[rule.fate]
    if rule.fate is Fate.REFUSED and rule.inert:
        fate += " unless " + " or ".join(_value(v) for v in rule.inert)
    note = rule.note.replace("|", "\\|")
    return f"| `{rule.key}` | {fate} | {note} |"


def keys_table() -> str:
    """The Markdown table of every rule in ``KEYS``, in its order."""
    rows = [
        "| Key | What genworker does | Why, or what to use instead |",
        "|---|---|---|",
        *(_row(rule) for rule in KEYS),
    ]
    return "\n".join(rows)


def _split(text: str) -> tuple[str, str, str]:
    """The text up to the table's start marker line, the table, and from its end marker."""
    head, found, rest = text.partition(TABLE_START + "\n")
    table, found_end, tail = rest.partition(TABLE_END)
    if not (found and found_end):
        raise ValueError(f"{NEMO_RL} lacks the lines {TABLE_START!r} ... {TABLE_END!r}")
    return head + found, table.removesuffix("\n"), found_end + tail


def test_the_nemo_rl_key_table_is_keys() -> None:
    _, table, _ = _split(NEMO_RL.read_text(encoding="utf-8"))
    assert table == keys_table(), "regenerate it: python tests/shell/test_docs.py --write"
    assert table.count("\n| `") == len(KEYS)


def test_the_key_table_has_a_row_per_rule_with_its_fate() -> None:
    rows = keys_table().splitlines()[2:]
    assert len(rows) == len(KEYS)
    for rule, row in zip(KEYS, rows, strict=True):
        assert row.startswith(f"| `{rule.key}` | {_FATE_TEXT[rule.fate]}")
    quant = next(r for r in rows if r.startswith("| `quant_cfg` |"))
    assert "refused unless `null`" in quant


# -- the README ---------------------------------------------------------------------------


def test_the_readme_is_short_and_shows_the_commands() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for command in ("make setup", "make test", "make demo", "make bench", "genworker generate",
                    "genworker serve"):  # fmt: skip
        assert command in text, command


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_points_at_a_file() -> None:
    missing = [
        f"{path.relative_to(REPO)}: {target}"
        for path in DOCS
        for target in _LINK.findall(path.read_text(encoding="utf-8"))
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not missing


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    head, _, tail = _split(NEMO_RL.read_text(encoding="utf-8"))
    NEMO_RL.write_text(head + keys_table() + "\n" + tail, encoding="utf-8")
