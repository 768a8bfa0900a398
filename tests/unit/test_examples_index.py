"""docs/examples.md lists every example script (examples/, the train*.py scripts at the root and the
modules of hvdtrain/examples/), and nothing that is gone."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "examples.md"


def is_script(path):
    """A file run as a script; a module beside it that the script imports (examples/lm_recipe/corpus.py)
    is documented by the script's row and its page."""
    return 'if __name__ == "__main__":' in path.read_text()


def scripts():
    found = [*(path for path in [*ROOT.glob("train*.py"), *(ROOT / "examples").rglob("*.py")] if is_script(path)),
             *(path for path in (ROOT / "hvdtrain" / "examples").glob("*.py") if path.name != "__init__.py")]
    return {path.relative_to(ROOT).as_posix() for path in found}


def listed():
    """The paths the index's tables give in their first column."""
    return set(re.findall(r"^\| `([\w/.-]+\.py)` \|", INDEX.read_text(), flags=re.MULTILINE))


def test_every_example_script_is_listed_with_its_line():
    assert scripts(), "no example scripts found: the test looks in the wrong place"
    missing = sorted(scripts() - listed())
    assert not missing, f"add these to {INDEX.relative_to(ROOT)}, each with one line and its launch: {missing}"


def test_every_listed_script_exists():
    gone = sorted(listed() - scripts())
    assert not gone, f"{INDEX.relative_to(ROOT)} lists scripts that are not there: {gone}"


def test_every_script_in_examples_has_its_launch_command():
    rows = {match.group(1): match.group(2) for match in
            re.finditer(r"^\| `((?:examples/|train)[\w/.-]*\.py)` \|.*\| `([^`]+)` \|$", INDEX.read_text(), re.MULTILINE)}
    for script in sorted(path for path in scripts() if not path.startswith("hvdtrain/")):
        assert script in rows.get(script, ""), f"{script}: its row's last column is not a command that runs it"
