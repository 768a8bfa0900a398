"""The configuration reference page (docs/reference/configuration.md) is generated from the settings dataclasses and kept current."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reference_page_matches_the_code():
    result = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + "\nrun: python scripts/config_reference.py"


def test_reference_covers_every_section_of_both_examples():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.pop(0)
    text = config_reference.generate()
    for key in ("`checkpoint_dir`", "`timeline_steps`", "`progress`", "`channels`", "`val_fraction`",
                "`d_model`", "`seq_len`"):
        assert key in text
    assert text.count("**`train`**") == 1  # the library's defaults, once
