"""The commands README.md and docs/guide.md show a reader exist as written: every `tandem ...`
command line (in sh code blocks, and in inline code) parses with the CLI's own parser (its
subcommands, options and option values, without running anything), and every file it reads
is in the repository, written by an earlier command of the same page, or one of the few names
that stand for the reader's own files. A user once copied `--prompts question.dev.jsonl`,
which was nowhere. Plus: the links between the pages resolve, and the prompts file the
examples use ships in the package."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest
import typer.main

from tandem.bench import multiturn, workloads
from tandem.commands.app import app
from tandem.models import catalog

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/guide.md")
SHELL_FENCES = ("", "sh", "bash", "shell", "console")
# Names that stand for the reader's own files, as the pages use them; any other file a
# command reads must exist in the repository or be written by an earlier command of its page.
READERS_FILES = {"target.gguf", "draft.gguf", "app.py"}
OUTPUTS = {"out"}  # file options a command writes, not reads
ROOT_COMMAND = typer.main.get_command(app)


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    argv: tuple[str, ...]  # after `tandem`
    stdin: str | None  # a file given with `<`

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: tandem {shlex.join(self.argv)}"


def is_placeholder(token: str) -> bool:
    """TARGET, FILE, HOST:PORT, KEY, "...": words the reader replaces, never checked as
    values (no lower-case letter in them, or an ellipsis)."""
    return "..." in token or (any(c.isalpha() for c in token) and not any(c.islower()
                                                                            for c in token))


def _segments(text: str) -> list[list[str]]:
    """A shell line's simple commands (split at | && || ;), comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in ("|", "||", "&&", ";", "&"):
            out.append([])
        else:
            out[-1].append(token)
    return [seg for seg in out if seg]


def _commands_in(text: str, page: str, line: int) -> list[DocCommand]:
    found = []
    try:
        segments = _segments(text)
    except ValueError:  # an open quote: a line a shell would not run either
        bad = re.match(r"\s*(\$\s*)?tandem\b", text)
        return [DocCommand(page, line, ("--unparseable-shell-line",), None)] if bad else []
    for seg in segments:
        while seg and (seg[0] == "$" or re.fullmatch(r"[A-Za-z_]\w*=.*", seg[0])):
            seg = seg[1:]  # a prompt sign, VAR=value
        if not seg or seg[0] != "tandem":
            continue
        argv, stdin, i = [], None, 1
        while i < len(seg):
            if seg[i] == "<" and i + 1 < len(seg):
                stdin, i = seg[i + 1], i + 2
            elif seg[i] in (">", ">>", "2>") and i + 1 < len(seg):
                i += 2
            else:
                argv.append(seg[i])
                i += 1
        found.append(DocCommand(page, line, tuple(argv), stdin))
    return found


def doc_commands(page: str, root: Path = ROOT) -> list[DocCommand]:
    """Every `tandem` command of a page: each line of its shell code blocks (backslash
    continuations joined) and each inline code span that starts with `tandem `."""
    text = (root / page).read_text(encoding="utf-8")
    commands: list[DocCommand] = []
    prose: list[str] = []
    fence: str | None = None
    pending, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            prose.append("")
            continue
        if fence is None:
            prose.append(raw)
            continue
        prose.append("")
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = no
        pending += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
        if raw.endswith("\\"):
            continue
        commands += _commands_in(pending, page, start)
        pending = ""
    joined = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        span = " ".join(m.group(1).split())
        if span.startswith("tandem "):
            commands += _commands_in(span, page, joined.count("\n", 0, m.start()) + 1)
    return commands


def parse(argv: tuple[str, ...]):
    """[(command, {param: raw value})] from the root down, by the CLI's own parser: unknown
    options, missing option values, unknown subcommands and extra arguments raise."""
    cmd, name, args, chain = ROOT_COMMAND, "tandem", list(argv), []
    while True:
        ctx = cmd.make_context(name, [], resilient_parsing=True)  # a context, nothing run
        ctx.resilient_parsing = False
        opts, rest, order = cmd.make_parser(ctx).parse_args(list(args))
        chain.append((cmd, ctx, {p.name: opts[p.name] for p in order if p.name in opts}))
        if not hasattr(cmd, "commands"):
            assert not rest, f"unexpected extra arguments {rest}"
            return chain
        if not rest:
            return chain
        sub = cmd.get_command(ctx, rest[0])
        assert sub is not None, f"no command {rest[0]!r} under {name}"
        cmd, name, args = sub, rest[0], rest[1:]


def _values(raw) -> list[str]:
    return [str(v) for v in (raw if isinstance(raw, (list, tuple)) else [raw]) if v is not None]


def check_command(c: DocCommand, written: set[str]) -> list[str]:
    """What is wrong with one command line (empty: nothing); adds the files it writes to
    `written`."""
    try:
        chain = parse(c.argv)
    except Exception as exc:  # the parser's own errors: NoSuchOption, BadOptionUsage...
        return [f"{c}: {type(exc).__name__}: {exc}"]
    problems = []
    names = set(catalog.pair_names()) | {a for p in catalog.load_catalog().values()
                                         for a in p.aliases}
    for cmd, ctx, raw in chain:
        for param in cmd.params:
            if param.name not in raw or raw[param.name] is None:
                continue
            values = _values(raw[param.name])
            if param.name in OUTPUTS:
                written.update(values)
            elif param.type_descriptor.is_path:
                problems += [f"{c}: {param.name} {v!r}: no such file" for v in values
                             if not _readable(v, written)]
            elif any(is_placeholder(v) for v in values):
                continue
            else:
                try:
                    param.get_runtime_param().coerce(raw[param.name], param=param, ctx=ctx)
                except Exception as exc:
                    problems.append(f"{c}: {param.name}: {exc}")
            if param.name == "pair" and cmd.name in ("pull", "hw"):
                problems += [f"{c}: no catalog pair {v!r}" for v in values
                             if not is_placeholder(v) and v not in names]
    if c.stdin is not None and not _readable(c.stdin, written):
        problems.append(f"{c}: < {c.stdin!r}: no such file")
    return problems


def _readable(value: str, written: set[str]) -> bool:
    return (value == "-" or is_placeholder(value) or value in READERS_FILES
            or value in written or (ROOT / value).exists())


@pytest.mark.parametrize("page", PAGES)
def test_every_command_on_the_page_exists(page):
    commands = doc_commands(page)
    assert len(commands) >= 10, [str(c) for c in commands]  # the reader found them at all
    written: set[str] = set()
    problems = [p for c in commands for p in check_command(c, written)]
    assert problems == []


def test_the_checker_catches_what_a_user_would_hit():
    """The checks fail where a reader's copy would: a file that is nowhere, an option or
    subcommand that does not exist, a value of the wrong type, an unknown pair."""
    def problems(line: str) -> list[str]:
        return [p for c in _commands_in(line, "t.md", 1) for p in check_command(c, set())]

    assert problems("tandem spec-bench --prompts cli/tandem/data/spec_bench.jsonl --quick") == []
    assert "no such file" in problems("tandem spec-bench --prompts question.dev.jsonl")[0]
    assert "NoSuchOption" in problems("tandem run --no-such-flag hi")[0]
    assert "BadOptionUsage" in problems("tandem hw costs --out")[0]
    assert "no command 'lsit'" in problems("tandem pairs lsit")[0]
    assert "extra arguments" in problems("tandem hw costs unexpected")[0]
    assert "max_tokens" in problems("tandem run -n many hi")[0]
    assert "no catalog pair" in problems("tandem pull no-such-pair")[0]
    assert "no such file" in problems("git diff | tandem run -s hi < missing.py")[0]
    # placeholders and the reader's own files are words to replace, not files to find
    assert problems("tandem pairs check TARGET DRAFT") == []
    assert problems("tandem run -m target.gguf -md draft.gguf --context-file app.py hi") == []
    # a file an earlier command of the page writes
    written: set[str] = set()
    for line in ("tandem hw costs --out costs.json",
                 "tandem spec-bench --quick --predict-costs costs.json"):
        assert [p for c in _commands_in(line, "t.md", 1)
                for p in check_command(c, written)] == []


def test_inline_and_continued_commands_are_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `tandem pairs\ncheck A B` first.\n\n```sh\nTANDEM_HOME=/x tandem run \\\n"
                    "  --strategy none hi   # a comment\n```\n\n```python\ntandem = 1\n```\n")
    assert [(c.line, c.argv) for c in doc_commands("p.md", tmp_path)] == [
        (5, ("run", "--strategy", "none", "hi")), (1, ("pairs", "check", "A", "B"))]


# ------------------------------------------------------------------------------ links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text, anchors, fence = page.read_text(encoding="utf-8"), set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


@pytest.mark.parametrize("page", [*PAGES, "docs/benchmarks.md"])
def test_links_resolve(page):
    """Relative links go to files that exist, and their #anchors to headings there (the
    summary links into the run log's sections)."""
    path = ROOT / page
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and anchor not in _anchors(dest):
            bad.append(target)
    assert bad == []


def test_the_log_keeps_the_section_numbers_the_repository_cites():
    """"docs/benchmarks.md section N" in code and docs means the log's section N."""
    log = (ROOT / "docs" / "benchmarks-log.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\. ", log, re.MULTILINE))
    cited = set()
    for path in [*ROOT.glob("docs/*.md"), *ROOT.glob("cli/**/*.py"), *ROOT.glob("scripts/*"),
                 *ROOT.glob("tests/*.py"), ROOT / "README.md", ROOT / "Makefile"]:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            cited |= set(re.findall(r"benchmarks(?:-log)?\.md,?\s+(?:section\s+)?(\d+)\b", text))
    assert cited and cited <= sections, cited - sections
    assert sections == {str(n) for n in range(21)}


# --------------------------------------------------------------------- prompts file


def test_the_shipped_spec_bench_prompts_parse_and_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    path = ROOT / "cli" / "tandem" / "data" / "spec_bench.jsonl"
    prompts = workloads.read_file(path)
    categories = {p.category for p in prompts}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag"} <= categories
    assert set(workloads.MT_BENCH) <= categories
    grouped = workloads.select(workloads.group_mt_bench(prompts), per_category=5)
    assert {p.category for p in grouped} >= {"mt-bench", "rag"}
    assert len(multiturn.spec_bench_conversations(path)) == 2 * len(workloads.MT_BENCH)
    # Apache-2.0: its license and where the rows come from travel with it
    for name in ("spec_bench.LICENSE", "spec_bench.README.txt"):
        assert (path.parent / name).is_file(), name
    assert "Apache License" in (path.parent / "spec_bench.LICENSE").read_text()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["tandem"]
    for name in ("spec_bench.jsonl", "spec_bench.LICENSE", "spec_bench.README.txt"):
        assert any(fnmatch(f"data/{name}", g) for g in globs), name
