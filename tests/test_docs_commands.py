"""The README stays short and true: every ``moe-offload`` command in its code blocks parses with the real parser,
it has at most ``MAX_README_LINES`` lines, shows the picture, and every relative link in it (and in the docs pages
it leads to) points to a file that exists, at a heading that exists."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PICTURE = "docs/img/decode-vs-share.png"
MAX_README_LINES = 160
#: the pages whose links are checked: the README and the docs pages written for it
LINKED_PAGES = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "run-conditions.md", ROOT / "docs" / "benchmarks.md"]
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
_SHELL_WORDS = {"do", "then", "else", "time", "exec", "{", "}"}
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(text: str):
    """``(first_line_number, lines)`` of each fenced code block of a markdown text (1-based line numbers)."""
    block, start = None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is None:
                block, start = [], n + 1
            else:
                yield start, block
                block = None
        elif block is not None:
            block.append(line)


def shell_lines(start: int, lines: list[str]):
    """``(line_number, text)`` of each logical shell line: ``\\``-continued lines joined."""
    buf, first = "", None
    for n, line in enumerate(lines, start):
        first = n if first is None else first
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        yield first, buf + line
        buf, first = "", None
    if buf:
        yield first, buf


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line: comments dropped, split at ``&&``, ``;``, ``|`` ..., each without its
    leading environment assignments (``OMP_NUM_THREADS=1``) and shell keywords (``do``)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in _SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for words in commands:
        while words and (_ENV.match(words[0]) or words[0] in _SHELL_WORDS):
            words = words[1:]
        if words:
            out.append(words)
    return out


def readme_commands(text: str) -> list[tuple[int, str, list[str]]]:
    """``(line_number, line, argv)`` for every ``moe-offload`` command (``moe-offload``, ``.venv/bin/moe-offload``,
    any path ending in ``/moe-offload``) in the fenced code blocks of ``text``; argv without the program."""
    found = []
    for start, block in code_blocks(text):
        for n, line in shell_lines(start, block):
            try:
                commands = simple_commands(line)
            except ValueError:  # not shell (an output sample, JSON): no command of ours
                continue
            found += [(n, line, words[1:]) for words in commands if words[0].rsplit("/", 1)[-1] == "moe-offload"]
    return found


def parse(argv: list[str]) -> None:
    """Parse ``argv`` with ``moe-offload``'s parser."""
    from moe_offload.cli import build_parser

    build_parser().parse_args(argv)


def test_readme_commands_parse(capsys):
    commands = readme_commands(README.read_text())
    assert len(commands) >= 10, f"found only {len(commands)} moe-offload commands in README.md: {commands}"
    failures = []
    for n, line, argv in commands:
        try:
            parse(argv)
        except SystemExit as e:
            if e.code == 0 and {"-h", "--help", "--version"} & set(argv):
                continue
            err = capsys.readouterr().err.strip().splitlines()
            failures.append(f"README.md:{n}: {line.strip()}\n    -> {err[-1] if err else f'exit {e.code}'}")
    assert not failures, "README commands that do not parse:\n" + "\n".join(failures)


def test_the_two_commands_that_head_the_readme():
    head = README.read_text().splitlines()[:15]
    assert ("scripts/setup.sh && .venv/bin/moe-offload generate        # set up, then generate on the built-in "
            "testbed MoE") in head
    assert "scripts/setup.sh && .venv/bin/python -m pytest            # set up, then run the tests (what CI runs)" in head


def test_readme_is_short_and_shows_the_picture():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert f"]({PICTURE})" in text
    assert (ROOT / PICTURE).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page (outside code blocks; repeated headings get ``-1``, ``-2`` ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            slug = github_anchor(line.lstrip("#"))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    text = page.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links in code blocks are not links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_command_extraction():
    text = "\n".join([
        "```bash",
        "OMP_NUM_THREADS=1 moe-offload bench decode --model testbed-sparse \\",
        "    --residencies 0.45  # (2); run 2 reversed",
        "scripts/setup.sh && .venv/bin/moe-offload generate   # set up",
        'for p in lru lfu; do OMP_NUM_THREADS=1 moe-offload generate --policy $p --json; done',
        "curl -s http://x/v1/messages -d '{\"a\": \"moe-offload x\"}'",
        "```",
        "moe-offload outside a block",
        "```",
        'hit rate 23.2%: it said "moe-offload',
        "```",
    ])
    got = [(n, argv) for n, _line, argv in readme_commands(text)]
    assert got == [(2, ["bench", "decode", "--model", "testbed-sparse", "--residencies", "0.45"]),
                   (4, ["generate"]), (5, ["generate", "--policy", "$p", "--json"])]
