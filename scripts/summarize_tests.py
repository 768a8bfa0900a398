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

PHASES = {"single": "one process", "mpi": "mpirun", "gloo": "horovodrun --gloo", "cluster": "two-host cluster"}
ONE_PROCESS = ("single", "cluster")


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
    parser.add_argument("results", type=Path)
    parser.add_argument("--ranks", type=int, required=True)
    args = parser.parse_args(argv)

    total: Counter = Counter()
    ok = True
    for phase, title in PHASES.items():
        files = ([args.results / f"{phase}.xml"] if phase in ONE_PROCESS
                 else [args.results / f"{phase}-rank{r}.xml" for r in range(args.ranks)])
        missing = [f.name for f in files if not f.exists()]
        if missing:
            print(f"{title}: no results from {', '.join(missing)} (crashed or timed out)")
            ok = False
            continue
        counts = merge_ranks([outcomes(f) for f in files])
        ranks = "" if phase in ONE_PROCESS else f" (each in {args.ranks} ranks)"
        print(f"{title}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped{ranks}")
        total += counts
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if ok and total["failed"] == 0 and total["passed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
