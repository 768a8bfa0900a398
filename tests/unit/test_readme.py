"""The README stays the short front door: it gives the two set-up commands exactly, and every link
in it to a file of the repository (and to a heading in it) resolves. Its runnable example runs in
test_docs_examples.py."""
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
# What a reader types first, and what CI and the Makefile mean by them.
COMMANDS = ("make train", "make test")


def anchor(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc (mkdocs) and GitHub make it for plain text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set:
    """The anchors of a Markdown file's headings, those inside fenced blocks left out."""
    return {anchor(title) for title in HEADING.findall(FENCE.sub("", markdown))}


def broken_links(path: Path, root: Path = ROOT) -> list:
    """Each relative link of ``path`` whose file, or heading in it, does not exist (paths shown from ``root``)."""
    text = path.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... are not the repository's
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(root) if linked.is_relative_to(root) else linked}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading #{fragment} in {linked.relative_to(root)}")
    return broken


def test_the_readme_gives_the_two_commands_in_a_shell_block():
    commands = [line.split("#")[0].strip() for language, body in FENCE.findall(README.read_text())
                if language in ("bash", "sh", "shell") for line in body.splitlines()]
    for command in COMMANDS:
        assert command in commands, f"README.md must give `{command}` as a command line of a ```bash block"


def test_every_relative_link_of_the_readme_resolves():
    links = LINK.findall(README.read_text())
    assert len(links) >= 10, links  # the README is mostly links to the docs: a broken pattern finds none
    assert broken_links(README) == []


def test_a_broken_link_or_heading_is_found(tmp_path):
    # The checker itself: a missing file and a missing heading are both reported.
    (tmp_path / "page.md").write_text("# Page\n\n## A `code` heading\n")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](page.md#a-code-heading) [gone](missing.md) [bad](page.md#nowhere) [web](https://x.org)\n")
    assert broken_links(readme, tmp_path) == ["missing.md: no file missing.md", "page.md#nowhere: no heading #nowhere in page.md"]
