"""The README and docs/ as a reader uses them: every `chunkstore ...` command in a shell block
parses with the real command-line parser, every `--kv-transfer-config` given to vLLM is JSON
that names the connector, and every relative link leads to a file (and heading) that exists.
No process is started."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chunkstore.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SHELL_LABELS = {"", "sh", "bash", "console", "shell"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)[^\n]*$")
# What ends a command for our purposes: a pipe, a list operator or a redirection.
OPERATOR_CHARS = set("|&;<>()")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Command:
    path: Path
    line: int  # where the command starts, 1-based
    text: str  # backslash continuations joined


def _blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(label, first line number, lines) of each fenced code block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, label = match.group(2), match.group(3).lower()
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        yield label, start + 1, lines[start:i]
        i += 1


def _balanced(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def _goes_on(command: str, quotes_span: bool) -> bool:
    return command.endswith("\\") or (quotes_span and not _balanced(command))


def shell_commands(path: Path, text: str | None = None) -> Iterator[Command]:
    """Every command of the shell blocks of a markdown file (or of ``text``, as if it were
    that file), with `$ ` prompts dropped, backslash continuations joined, quotes that span
    lines kept whole (in blocks labelled as shell), heredoc bodies skipped."""
    source = path.read_text() if text is None else text
    for label, first, lines in _blocks(source):
        if label not in SHELL_LABELS:
            continue
        i = 0
        while i < len(lines):
            start = i
            command = lines[i].strip()
            if command.startswith("$ "):
                command = command[2:]
            single = command
            # A quote may span lines in shell; an unlabelled block may be prose (a tree).
            quotes_span = label != ""
            while i + 1 < len(lines) and _goes_on(command, quotes_span):
                i += 1
                joined = command[:-1] if command.endswith("\\") else command + "\n"
                command = joined + lines[i].strip()
            if not _balanced(command):  # not shell (a tree, some prose): one line at a time
                command, i = single, start
            i += 1
            heredoc = HEREDOC.search(command)
            if heredoc:  # its body is another program's input
                while i < len(lines) and lines[i].strip() != heredoc.group(2):
                    i += 1
                i += 1
            if command:
                yield Command(path, first + start, command)


def words(text: str) -> list[str]:
    """The words of a command up to its first operator or comment; leading VAR=value
    assignments dropped. ValueError if its quotes do not close."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out: list[str] = []
    for token in lexer:
        if token and set(token) <= OPERATOR_CHARS:  # '' is a quoted empty argument
            if out and out[-1].isdigit() and token.startswith((">", "<")):
                out.pop()  # the 2 of 2>&1
            break
        out.append(token)
    while out and ASSIGNMENT.match(out[0]):
        out.pop(0)
    return out


def is_chunkstore(word: str) -> bool:
    return word == "chunkstore" or word.endswith("/chunkstore")


def all_commands() -> list[Command]:
    return [command for path in doc_files() for command in shell_commands(path)]


def where(command: Command) -> str:
    return f"{command.path.relative_to(ROOT)}:{command.line}: {command.text}"


def test_every_chunkstore_command_in_the_docs_parses() -> None:
    parser = build_parser()
    checked, failures = 0, []
    for command in all_commands():
        first = (command.text.split() or [""])[0]
        try:
            argv = words(command.text)
        except ValueError as err:
            if is_chunkstore(first):
                failures.append(f"{where(command)}\n  {err}")
            continue
        if not argv or not is_chunkstore(argv[0]):
            continue
        checked += 1
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
                parser.parse_args(argv[1:])
        except SystemExit as exit_:
            if exit_.code not in (0, None):  # --help exits 0
                why = said.getvalue().strip().splitlines()[-1:] or ["exit " + str(exit_.code)]
                failures.append(f"{where(command)}\n  {why[0]}")
    assert checked >= 10, f"only {checked} chunkstore commands found: is the extraction broken?"
    assert not failures, "commands the CLI refuses:\n" + "\n".join(failures)


def test_every_kv_transfer_config_names_the_connector() -> None:
    checked, failures = 0, []
    for command in all_commands():
        try:
            argv = words(command.text)
        except ValueError as err:
            if "--kv-transfer-config" in command.text:
                failures.append(f"{where(command)}\n  {err}")
            continue
        for i, word in enumerate(argv):
            value = None
            if word == "--kv-transfer-config" and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith("--kv-transfer-config="):
                value = word.split("=", 1)[1]
            if value is None:
                continue
            checked += 1
            try:
                config = json.loads(value)
            except json.JSONDecodeError as err:
                failures.append(f"{where(command)}\n  not JSON: {err}")
                continue
            if not isinstance(config, dict) or config.get("kv_connector") != "ChunkStoreConnector":
                failures.append(f"{where(command)}\n  kv_connector is not ChunkStoreConnector")
    assert checked >= 2, f"only {checked} --kv-transfer-config found: is the extraction broken?"
    assert not failures, "\n".join(failures)


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans."""
    lines, inside, fence = [], False, ""
    for line in text.split("\n"):
        match = FENCE.match(line)
        if match and (not inside or line.strip().startswith(fence)):
            inside, fence = not inside, match.group(2)
            lines.append("")
            continue
        lines.append("" if inside else re.sub(r"(`+).*?\1", "", line))
    return "\n".join(lines)


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_headings(path.read_text()):
        slug = re.sub(r"[^\w\- ]", "", line.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def _prose_headings(text: str) -> Iterator[str]:
    inside, fence = False, ""
    for line in text.split("\n"):
        match = FENCE.match(line)
        if match and (not inside or line.strip().startswith(fence)):
            inside, fence = not inside, match.group(2)
            continue
        if not inside and re.match(r"^#{1,6} ", line):
            heading = line.lstrip("#").strip()
            yield re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only


def relative_links(path: Path) -> Iterator[str]:
    prose = _prose(path.read_text())
    for target in [*LINK.findall(prose), *REFERENCE.findall(prose)]:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
            continue
        yield target


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor in {destination.name}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_name_only_what_a_clone_holds(path: Path) -> None:
    """Nothing outside the repository, linked or named in backquotes: the pages beside a
    checkout (../shared/) are not in a clone."""
    above = "../" * len(path.parent.relative_to(ROOT).parts) + "../"  # the clone's parent
    lines = path.read_text().splitlines()
    outside = [line for line in lines if above in line or "../shared/" in line]
    assert outside == [], f"{path.relative_to(ROOT)} names what a clone does not hold"


def test_the_extraction_reads_shell_as_bash_does() -> None:
    """The parsing rules above, on the shapes the docs use."""
    script = (
        "```sh\n"
        "$ chunkstore stats --json | jq .   # a prompt, a pipe, a comment\n"
        "chunkstore serve --socket '' 2>&1; echo\n"
        "FOO=1 .venv/bin/chunkstore drain \\\n"
        "  --timeout 10 && echo done\n"
        'vllm serve m --kv-transfer-config \'{"kv_connector":\n'
        '  "ChunkStoreConnector"}\' &\n'
        "python - <<'PY'\n"
        "chunkstore is not a command here\n"
        "PY\n"
        "```\n"
        "```\n"  # a tree, not shell: its apostrophes never close
        "chunkstore/   the daemon's code\n"
        "docs/         the README's pages\n"
        "```\n"
    )
    commands = [c.text for c in shell_commands(ROOT / "docs" / "example.md", script)]
    assert [words(text) for text in commands[:5]] == [
        ["chunkstore", "stats", "--json"],
        ["chunkstore", "serve", "--socket", ""],
        [".venv/bin/chunkstore", "drain", "--timeout", "10"],
        ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector":\n"ChunkStoreConnector"}'],
        ["python", "-"],
    ]
    assert commands[5:] == ["chunkstore/   the daemon's code", "docs/         the README's pages"]
    with pytest.raises(ValueError):
        words(commands[5])


# What docs/ may weigh (issue 95: a newcomer reads it in an evening). Every file counts, the
# pictures and the device check's report included; history lives in git.
DOCS_MAX_BYTES = 160 * 1024
PAGE_MAX_BYTES = 40 * 1024
README_MAX_BYTES = 12 * 1024  # one page


def test_docs_stay_small_enough_to_read() -> None:
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    heavy = [
        f"{p.relative_to(ROOT)}: {p.stat().st_size:,} bytes"
        for p in sorted((ROOT / "docs").glob("*.md"))
        if p.stat().st_size > PAGE_MAX_BYTES
    ]
    assert not heavy, f"pages over {PAGE_MAX_BYTES:,} bytes (split them by topic):\n" + "\n".join(
        heavy
    )
    readme = (ROOT / "README.md").stat().st_size
    assert readme <= README_MAX_BYTES, f"README.md: {readme:,} bytes: one page, a few figures"
    assert total <= DOCS_MAX_BYTES, (
        f"docs/ holds {total:,} bytes, over {DOCS_MAX_BYTES:,}: keep each bench's latest table "
        "and what is left, not the history (git log -p keeps it)"
    )


# Citations in the code: a page of the repository (docs/x.md, README.md), a heading of it
# (docs/x.md#anchor, or docs/x.md, "Heading"), never a page beside the checkout nor the design
# documents the project started from ("seed 002"), which a clone does not hold.
CITED_PAGE = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w./-]*?[\w-]+\.md)\b(?:#([\w-]+))?")
CITED_HEADING = re.compile(r"(docs/[\w-]+\.md)(?:,\s*|\s+\(?)[\"']([^\"'\n]+)[\"']")
SEED = re.compile(r"\bseeds?\s+0\d\d\b", re.I)
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.I)
CODE_DIRS = ("chunkstore", "connector", "tests", "deploy", "docker", ".ci")
CODE_FILES = ("Makefile", "pyproject.toml")


def _code_files() -> list[Path]:
    found = [ROOT / name for name in CODE_FILES]
    for folder in CODE_DIRS:
        found += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix not in {".png", ".pyc", ".so", ".gguf"}
            and not p.name.endswith("_pb2.py")
        ]
    return sorted(set(found) - {Path(__file__).resolve()})


def _prose_of(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of what a file says to a reader: a Python file's strings (not one
    that is a path and nothing else: a test's fixture, not a citation) and its runs of
    comments, each whole (a citation may break across lines); any other file's lines."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    import tokenize

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        yield from enumerate(text.splitlines(), 1)
        return
    run: list[tokenize.TokenInfo] = []
    for token in [*tokens, None]:
        if token is not None and token.type == tokenize.COMMENT:
            if run and token.start[0] != run[-1].start[0] + 1:
                yield run[0].start[0], "\n".join(c.string.lstrip("#").strip() for c in run)
                run = []
            run.append(token)
            continue
        if token is not None and token.type in (tokenize.NL, tokenize.NEWLINE):
            continue  # a comment's own line end: the run goes on
        if run:
            yield run[0].start[0], "\n".join(c.string.lstrip("#").strip() for c in run)
            run = []
        if token is not None and token.type == tokenize.STRING:
            body = token.string.strip("\"'rRbBfFuU")
            if not re.fullmatch(r"[\w./-]+", body):
                yield token.start[0], token.string


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def wrong_citations(path: Path, lines: Iterator[tuple[int, str]]) -> Iterator[str]:
    """What ``lines`` of ``path`` cite that the repository does not hold."""
    pages = {p.name for p in ROOT.glob("*.md")} | {p.name for p in (ROOT / "docs").glob("*.md")}
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for number, text in lines:
        at = f"{where}:{number}"
        line = URL.sub("", text)
        for seed in SEED.findall(line):
            yield (
                f"{at}: {seed!r}: the seed documents are not in the repository; cite the "
                "method by name (docs/design.md#sources)"
            )
        for page, anchor in CITED_PAGE.findall(line):
            if page.startswith("../"):
                yield f"{at}: {page}: outside the repository"
            elif "/" in page:
                target = ROOT / page
                if not target.is_file():
                    yield f"{at}: {page}: no such file"
                elif anchor and anchor not in anchors(target):
                    yield f"{at}: {page}#{anchor}: no such heading"
            elif page not in pages:
                yield f"{at}: {page}: not a page of the repository"
        for page, heading in CITED_HEADING.findall(line):
            target = ROOT / page
            slug = _slug(heading.replace("`", ""))
            if target.is_file() and not any(a.startswith(slug) for a in anchors(target)):
                yield f'{at}: {page}, "{heading}": no such heading'


def test_code_cites_only_pages_and_headings_the_repository_holds() -> None:
    wrong = [w for path in _code_files() for w in wrong_citations(path, _prose_of(path))]
    assert not wrong, "citations a clone cannot follow:\n" + "\n".join(wrong)


def test_pages_cite_no_seed_and_no_missing_page() -> None:
    wrong = [
        w
        for path in doc_files()
        for w in wrong_citations(path, enumerate(_prose(path.read_text()).splitlines(), 1))
        if "seed" in w or "outside" in w
    ]
    assert not wrong, "\n".join(wrong)


def test_a_citation_the_repository_does_not_hold_is_found() -> None:
    """The checks above can fail: a design document beside the checkout, a seed, a page or
    a heading that is not there, each found; a page and heading that exist, not."""
    design, seed = "DESIGN" + ".md", "seed " + "003"
    lines = enumerate(
        [
            f"Rules ({design}, 'Semantics').",
            f"merged by their log-sum-exp ({seed}'s online softmax)",
            "see docs/nowhere.md and ../shared/research/notes.md",
            "docs/semantics.md#no-such-heading",
            'docs/daemon.md, "No such section"',
            'docs/daemon.md#fast-path; docs/daemon.md, "Trust between daemons"; README.md',
        ],
        1,
    )
    found = list(wrong_citations(ROOT / "x.py", lines))
    assert [w.split(":")[1] for w in found] == ["1", "2", "3", "3", "4", "5"], found


def test_a_citation_broken_across_comment_lines_is_read_whole(tmp_path: Path) -> None:
    """A run of comments is read as one text (a seed named across a line end is found); a
    string that is a path and nothing else is a fixture, not a citation."""
    source = tmp_path / "cited.py"
    source.write_text(
        "# chosen by its blocks (seed\n# " + "002; docs/sparse-loads.md)\n"
        'FIXTURE = "docs/guide.md"\n'
        "x = 1  # docs/daemon.md#fast-path\n"
    )
    found = list(wrong_citations(source, _prose_of(source)))
    assert len(found) == 1 and "seed" in found[0], found
