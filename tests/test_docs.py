"""The documentation against the code: docs/cli.md against ``--help``, the README's examples
run as they are shown, and every relative link points to a file (and heading) that exists."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchfit.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_MD = ROOT / "docs" / "cli.md"
# the pages this test may hold to their headings too (the others are checked for files only)
OWN_PAGES = (
    README,
    ROOT / "CONTRIBUTING.md",
    ROOT / "CHANGELOG.md",
    *(ROOT / "docs" / f"{n}.md" for n in ("cli", "how-we-count", "planner", "python")),
    *(ROOT / "docs" / f"{n}.md" for n in ("training", "design")),
)
# the commands that take the setup options, documented once in docs/cli.md "Setup options"
SETUP_COMMANDS = ("estimate", "plan", "gpus", "probe")
_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _root_command() -> Any:
    """The click command tree of ``batchfit`` (typer's app, wherever the CLI package keeps it)."""
    import importlib
    import types

    import typer.main

    app = getattr(importlib.import_module("batchfit.cli"), "app", None)
    if app is None or isinstance(app, types.ModuleType):
        app = importlib.import_module("batchfit.cli.app").app
    return typer.main.get_command(app)


def _options(command: Any, parent: Any = None) -> set[str]:
    """The option strings ``command --help`` lists (``--grad-ckpt``, ``--no-grad-ckpt``, ...)."""
    ctx = command.context_class(command, parent=parent, **command.context_settings)
    found: set[str] = set()
    for param in command.get_params(ctx):
        if param.param_type_name == "option":
            found.update(param.opts, param.secondary_opts)
    return found


def _sections(text: str) -> dict[str, str]:
    """``## heading`` -> the text under it."""
    parts = re.split(r"^## +(.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _table_options(section: str) -> set[str]:
    """The options in the first cell of each table row of a section."""
    found: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        found.update(_OPTION.findall(line.split("|")[1]))
    return found


@pytest.fixture(scope="module")
def cli_doc() -> dict[str, set[str]]:
    sections = _sections(CLI_MD.read_text())
    return {name: _table_options(body) for name, body in sections.items()}


def test_every_command_and_option_of_help_is_in_cli_md(cli_doc):
    root = _root_command()
    root_ctx = root.context_class(root, **root.context_settings)
    missing = sorted(_options(root) - cli_doc["Everywhere"])
    for name, command in root.commands.items():
        assert name in cli_doc, f"docs/cli.md has no '## {name}' section"
        documented = cli_doc[name] | cli_doc["Everywhere"]
        if name in SETUP_COMMANDS:
            documented |= cli_doc["Setup options"]
        missing += [f"{name} {o}" for o in sorted(_options(command, root_ctx) - documented)]
    assert not missing, f"options --help lists that docs/cli.md does not document: {missing}"


def test_every_option_cli_md_documents_exists(cli_doc):
    root = _root_command()
    root_ctx = root.context_class(root, **root.context_settings)
    real = {name: _options(command, root_ctx) for name, command in root.commands.items()}
    extra = [f"{name} {o}" for name in real for o in sorted(cli_doc[name] - real[name])]
    extra += [
        f"setup {o}" for n in SETUP_COMMANDS for o in sorted(cli_doc["Setup options"] - real[n])
    ]
    everywhere = _options(root) | set.intersection(*real.values())
    extra += [f"everywhere {o}" for o in sorted(cli_doc["Everywhere"] - everywhere)]
    assert not extra, f"options docs/cli.md documents that --help does not list: {extra}"


def test_readme_links_every_command_to_its_section():
    text = README.read_text()
    missing = [n for n in _root_command().commands if f"docs/cli.md#{n})" not in text]
    assert not missing, f"README has no link to docs/cli.md#<command> for: {missing}"


# --- the README's examples --------------------------------------------------------------------


def _code_blocks(text: str, lang: str = "") -> Iterator[str]:
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        if match.group(1) == lang:
            yield match.group(2)


def _shell_examples(text: str) -> list[tuple[list[str], int]]:
    """Each ``$ ...`` line of the README's plain code blocks (continued lines joined), with the
    exit code its shown output implies: 2 when it shows ``batchfit: error:``, else 0."""
    examples: list[tuple[list[str], int]] = []
    for block in _code_blocks(text):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("$ "):
                shown.append(lines[i])
                i += 1
            words = shlex.split(command.split(" #")[0])
            code = 2 if any(s.startswith("batchfit: error:") for s in shown) else 0
            examples.append((words, code))
    return examples


def test_readme_shows_examples_of_the_main_commands():
    shown = {words[1] for words, _ in _shell_examples(README.read_text()) if words[0] == "batchfit"}
    assert {"plan", "estimate", "probe", "monitor"} <= shown


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder with the repository's examples, its own (cold) cache and data folders,
    and this interpreter's folder first on PATH (the examples' ``python`` has batchfit)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHFIT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    # one thread in the examples' child processes: the suite's workers already share the cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def _run_batchfit(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
        raise SystemExit(0)
    captured = capfd.readouterr()
    return int(exc.value.code or 0), captured.out + captured.err


def test_readme_examples_run_with_the_exit_code_they_show(sandbox, capfd, monkeypatch):
    examples = _shell_examples(README.read_text())
    assert examples
    for words, code in examples:
        if words[0] == "python":  # an example script the next lines use (its config file)
            monkeypatch.setattr(sys, "argv", words[1:])
            runpy.run_path(str(ROOT / words[1]), run_name="__main__")
            continue
        assert words[0] == "batchfit", words
        got, output = _run_batchfit(words[1:], capfd)
        assert got == code, f"$ {shlex.join(words)} exited {got}, not {code}:\n{output[-2000:]}"


def test_readme_python_example_runs(sandbox, capsys):
    blocks = list(_code_blocks(README.read_text(), "python"))
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out


# --- links ------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#{1,6} +(.+)$", text, flags=re.MULTILINE)}


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))] + [
        p for p in (ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md") if p.exists()
    ]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        held_to_headings = anchor and page in OWN_PAGES and file.suffix == ".md"
        if not file.exists() or (held_to_headings and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    unlinked = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in text
    ]
    assert not unlinked, f"README links no: {unlinked}"
