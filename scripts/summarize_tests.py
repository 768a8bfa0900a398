"""One summary over the test launches of scripts/run_tests.sh, from their JUnit XML files.

A test run in several ranks counts once: failed if it failed in any rank, skipped if skipped in
all of them. A launch whose result files are missing (it crashed or timed out) is a failure.
"""
import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

PHASES_FILE = "phases.tsv"  # one line per launch, in order: key, ranks (0: one process), title


def read_phases(results: Path) -> List[Tuple[str, int, str]]:
    """The launches scripts/run_tests.sh announced before starting them."""
    phases = []
    for number, line in enumerate((results / PHASES_FILE).read_text().splitlines(), 1):
        fields = line.split("\t")
        key, ranks, title = fields if len(fields) == 3 else ("", "", "")
        if not key or not ranks.isdigit():
            raise ValueError(f"{results / PHASES_FILE} line {number}: expected 'key<TAB>ranks<TAB>title', got {line!r}")
        phases.append((key, int(ranks), title))
    return phases


def outcomes(path: Path) -> Dict[Tuple[str, str], str]:
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            outcome = "failed"
        elif "skipped" in kinds:
            outcome = "skipped"
        else:
            outcome = "passed"
        key = (case.get("classname", ""), case.get("name", ""))
        # A test that fails in teardown appears twice: keep the worse outcome.
        if result.get(key) != "failed":
            result[key] = outcome
    return result


def merge_ranks(per_rank: List[Dict[Tuple[str, str], str]]) -> Counter:
    merged: Dict[Tuple[str, str], str] = {}
    for rank_outcomes in per_rank:
        for key, outcome in rank_outcomes.items():
            previous = merged.get(key)
            if previous is None or outcome == "failed" or (previous == "skipped" and outcome == "passed"):
                merged[key] = outcome
    # A test one rank ran and another did not is a failure of the missing rank.
    for key in merged:
        if any(key not in rank_outcomes for rank_outcomes in per_rank):
            merged[key] = "failed"
    return Counter(merged.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, help=f"the directory of the XML files and {PHASES_FILE}")
    args = parser.parse_args(argv)

    total: Counter = Counter()
    ok = True
    for key, ranks, title in read_phases(args.results):
        files = ([args.results / f"{key}.xml"] if ranks == 0
                 else [args.results / f"{key}-rank{r}.xml" for r in range(ranks)])
        missing = [f.name for f in files if not f.exists()]
        if missing:
            print(f"{title}: no results from {', '.join(missing)} (crashed or timed out)")
            ok = False
            continue
        counts = merge_ranks([outcomes(f) for f in files])
        each = f" (each in {ranks} ranks)" if ranks else ""
        print(f"{title}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped{each}")
        total += counts
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if ok and total["failed"] == 0 and total["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
