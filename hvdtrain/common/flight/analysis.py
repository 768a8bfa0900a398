"""The ranks' flight records side by side: where they first disagree, and who is slow.

Divergence. Collectives are aligned on their sequence number in each process set (the same
number is the same operation on every rank of the set: hvdtrain.common.flight.recorder). Walking
the numbers every rank still holds, the first one where the ranks disagree is named:

    missing  some ranks entered it, another never did (at its dump: it stopped calling collectives,
             or skipped this one), e.g. "rank 1 never entered allreduce 'preempt.vote' ..."
    order    ranks entered different operations at that number, one of them still in flight (a
             rank that skipped one, or called two in another order): "rank 1 entered Y where
             rank 0 entered X". Different operations that all completed are no fault: Horovod
             matches asynchronous operations by name, so their order may differ.
    shape    the same operation with another shape or dtype (an allgather's first dimension, an
             alltoall's rows, may differ)

The expected operation is the one most ranks entered (a tie: the lowest rank's). Of several
process sets, the divergence that started first is named. A rank that dumped before the others
entered an operation is not counted as missing it (a dump on request is not instantaneous).

Stragglers. Each phase (data loading, forward and backward, ...) is summed per rank over the
steps every rank holds complete; the slowest rank is compared with the median of the others:
"rank 3's data loading is 1.40x the median of the others".

One world at a time. Under Horovod elastic the sequence numbers start again in each new world
(hvdtrain.common.flight.recorder), and a rank's file may be left from an earlier world (a rank
that left, or has not dumped since) or an earlier run in the same directory: a dump written before
the newest world's record began on some rank is set aside, named, and never compared. A collective
whose wait failed (a rank died) ended, with its error; it is listed, not taken for one in flight.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hvdtrain.common.flight.dumps import FORMAT

STRAGGLER_RATIO = 1.2  # a phase this much slower than the other ranks' median is named in the verdict


class DumpError(ValueError):
    """The dumps cannot be read or compared; the message says what to do."""


def load_dumps(directory: Path) -> List[Dict[str, Any]]:
    """Every rank's dump in a run directory's flight/ (or that directory itself), by rank."""
    directory = Path(directory)
    flight = directory / "flight" if (directory / "flight").is_dir() else directory
    paths = sorted(flight.glob("rank-*.json"))
    if not paths:
        raise DumpError(f"no flight records (flight/rank-*.json) in {directory}: a rank writes one on a stall, on "
                        f"SIGUSR2, or when `hvdtrain debug dump {directory}` asks (train.flight_recorder > 0, "
                        f"train.run_dir set)")
    dumps = []
    for path in paths:
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise DumpError(f"{path} is not a flight record ({error}): remove it, or dump again") from error
        if dump.get("format") != FORMAT:
            raise DumpError(f"{path} is of format {dump.get('format')!r}, not {FORMAT!r}: dump again with this hvdtrain")
        dumps.append(dump)
    return sorted(dumps, key=lambda d: d["rank"])


@dataclass
class Divergence:
    """The first collective the ranks disagree on."""
    kind: str  # missing, order, shape
    process_set: str
    seq: int
    expected: Dict[str, Any]  # the entry most ranks have
    expected_ranks: List[int]
    odd: Dict[int, Optional[Dict[str, Any]]]  # rank -> what it has instead (None: nothing)
    later: Dict[int, Optional[int]] = field(default_factory=dict)  # order: where it entered the expected one

    def sentence(self) -> str:
        where = f"seq {self.seq} of {_set_name(self.process_set)}"
        exp = _describe(self.expected)
        holders = _ranks(self.expected_ranks)
        parts = []
        for rank, entry in sorted(self.odd.items()):
            if self.kind == "missing":
                parts.append(f"rank {rank} never entered {exp} ({where}), which {holders} entered")
            elif self.kind == "order":
                later = self.later.get(rank)
                after = (f"it entered {_short(self.expected)} later, at seq {later}" if later is not None
                         else f"it never entered {_short(self.expected)}")
                parts.append(f"rank {rank} entered {_describe(entry)} where {holders} entered {exp} ({where}); {after}")
            else:
                parts.append(f"rank {rank} entered {_describe(entry, shape=True)} where {holders} entered "
                             f"{_describe(self.expected, shape=True)} ({where})")
        return "; ".join(parts)


@dataclass
class Straggler:
    phase: str
    rank: int
    ratio: float
    seconds: float
    others_median: float
    steps: int

    def sentence(self) -> str:
        return (f"rank {self.rank}'s {self.phase} is {self.ratio:.2f}x the median of the others "
                f"({self.seconds:.3g} s vs {self.others_median:.3g} s over {self.steps} steps)")


@dataclass
class Analysis:
    ranks: List[int]
    size: Optional[int]
    divergence: Optional[Divergence]
    stragglers: List[Straggler]  # the slowest rank of each phase, slowest first
    open_phases: Dict[int, Tuple[str, int, float]]  # rank -> (phase, step, seconds in it at the dump)
    last_seq: Dict[str, int]  # process set -> the last sequence number every rank held
    earlier_world: List[int] = field(default_factory=list)  # ranks whose dump is older than this world: set aside
    failed: List[Tuple[int, Dict[str, Any]]] = field(default_factory=list)  # (rank, entry) of waits that raised

    @property
    def missing_ranks(self) -> List[int]:
        return [r for r in range(self.size or 0) if r not in self.ranks]

    def verdict(self) -> str:
        """One line: the divergence, else the worst straggler, else that nothing stands out."""
        missing = f" (no dump from {_ranks(self.missing_ranks)})" if self.missing_ranks else ""
        if self.divergence is not None:
            line = self.divergence.sentence()
            for rank in sorted(self.divergence.odd):
                if rank in self.open_phases:
                    phase, step, seconds = self.open_phases[rank]
                    line += f"; rank {rank} was in {phase} after step {step} for {seconds:.0f} s"
            return line + missing
        slow = [s for s in self.stragglers if s.ratio >= STRAGGLER_RATIO]
        if slow:
            return f"no divergence in the collectives; straggler: {slow[0].sentence()}{missing}"
        return (f"no divergence in the collectives of {len(self.ranks)} ranks and no straggler "
                f"(>= {STRAGGLER_RATIO}x){missing}")

    def lines(self) -> List[str]:
        """The whole report, the verdict first."""
        out = [self.verdict(), ""]
        out.append(f"ranks dumped: {_ranks(self.ranks)}" + (f" of {self.size}" if self.size else ""))
        for key, seq in sorted(self.last_seq.items()):
            out.append(f"{_set_name(key)}: aligned up to seq {seq}")
        if self.earlier_world:
            out.append(f"set aside, written before this world's record began (an earlier world's or run's): the "
                       f"dumps of {_ranks(self.earlier_world)}")
        for rank, (phase, step, seconds) in sorted(self.open_phases.items()):
            out.append(f"rank {rank}: in {phase} after step {step} for {seconds:.1f} s at its dump")
        for rank, entry in self.failed:
            where = f"seq {entry['seq']} of {_set_name(str(entry['process_set']))}"
            out.append(f"rank {rank}: {_describe(entry)} ({where}) failed: {entry['error']}")
        if self.stragglers:
            out.append("slowest rank per phase:")
            out.extend(f"  {s.phase}: {s.sentence()}" for s in self.stragglers)
        return out


def analyze(dumps: List[Dict[str, Any]]) -> Analysis:
    """The ranks' dumps (load_dumps) compared (see the module's text)."""
    if not dumps:
        raise DumpError("no dumps to analyze")
    dumps, earlier = this_world(dumps)
    by_rank = {int(d["rank"]): d for d in dumps}
    found: List[Divergence] = []
    last_seq: Dict[str, int] = {}
    for key in sorted({str(e["process_set"]) for d in dumps for e in d["collectives"]}):
        divergence, last = _first_divergence(key, by_rank)
        last_seq[key] = last
        if divergence is not None:
            found.append(divergence)
    first = min(found, key=lambda d: d.expected["start"]) if found else None
    sizes = {d.get("size") for d in dumps} - {None}
    return Analysis(ranks=sorted(by_rank), size=max(sizes) if sizes else None, divergence=first,
                    stragglers=_stragglers(by_rank), open_phases=_open_phases(by_rank), last_seq=last_seq,
                    earlier_world=sorted(int(d["rank"]) for d in earlier), failed=_failed(by_rank))


def this_world(dumps: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(The dumps of the newest world, those written before its record began on some rank.) A rank's
    record begins when its world formed (a survivor of a world change) or its process started: a
    dump older than that was written in another world, or by another run."""
    began = max(d.get("world_since") or 0.0 for d in dumps)
    return [d for d in dumps if d["written"] >= began], [d for d in dumps if d["written"] < began]


def _failed(by_rank: Dict[int, Dict[str, Any]]) -> List[Tuple[int, Dict[str, Any]]]:
    return [(rank, entry) for rank, dump in sorted(by_rank.items()) for entry in dump["collectives"]
            if entry.get("error")]


def _members(key: str, by_rank: Dict[int, Dict[str, Any]]) -> List[int]:
    """The dumped ranks of process set ``key`` (a set's ranks as some dump described them; none: all)."""
    for dump in by_rank.values():
        ranks = dump.get("process_sets", {}).get(key)
        if ranks is not None:
            return [r for r in ranks if r in by_rank]
    return sorted(by_rank)


def _first_divergence(key: str, by_rank: Dict[int, Dict[str, Any]]) -> Tuple[Optional[Divergence], int]:
    """(The first divergence in process set ``key``, or None; the last sequence number compared)."""
    members = _members(key, by_rank)
    held = {r: {e["seq"]: e for e in by_rank[r]["collectives"] if str(e["process_set"]) == key} for r in members}
    # A rank that dropped the start of its record (its buffer is full) is compared from where it holds.
    starts = [min(entries) for entries in held.values() if entries]
    ends = [max(entries) for entries in held.values() if entries]
    if not starts:
        return None, -1
    last = -1
    for seq in range(max(starts), max(ends) + 1):
        present = {r: held[r][seq] for r in members if seq in held[r]}
        absent = [r for r in members if seq not in held[r]]
        groups: Dict[Tuple[str, Any], List[int]] = {}
        for rank, entry in present.items():
            groups.setdefault((entry["op"], entry["name"]), []).append(rank)
        expected_key = max(groups, key=lambda g: (len(groups[g]), -min(groups[g])))
        expected_ranks = groups[expected_key]
        expected = present[expected_ranks[0]]
        # A rank that wrote its dump before the others entered this one has not missed it.
        late = [r for r in absent if by_rank[r]["written"] >= expected["start"]]
        if late:
            return Divergence("missing", key, seq, expected, expected_ranks, {r: None for r in late}), last
        if absent:
            return None, last  # the remaining numbers were entered after some rank's dump
        if len(groups) > 1 and any(e["end"] is None for e in present.values()):
            odd = {r: present[r] for r in present if r not in expected_ranks}
            later = {r: _entered_later(held[r], seq, expected) for r in odd}
            return Divergence("order", key, seq, expected, expected_ranks, odd, later), last
        if len(groups) == 1:
            odd = {r: e for r, e in present.items() if not _same_shape(e, expected)}
            if odd:
                return Divergence("shape", key, seq, expected, [r for r in present if r not in odd], odd), last
        last = seq
    return None, last


def _entered_later(entries: Dict[int, Dict[str, Any]], seq: int, expected: Dict[str, Any]) -> Optional[int]:
    for later in sorted(s for s in entries if s > seq):
        if (entries[later]["op"], entries[later]["name"]) == (expected["op"], expected["name"]):
            return later
    return None


def _same_shape(entry: Dict[str, Any], expected: Dict[str, Any]) -> bool:
    if entry.get("dtype") != expected.get("dtype"):
        return False
    mine, theirs = entry.get("shape"), expected.get("shape")
    if entry["op"] == "alltoall" or mine is None or theirs is None:
        return True
    if entry["op"] in ("allgather", "grouped_allgather"):  # the first dimension may differ by rank
        trim = (lambda s: [x[1:] for x in s]) if entry["op"].startswith("grouped") else (lambda s: s[1:])
        return trim(mine) == trim(theirs)
    return mine == theirs


def _stragglers(by_rank: Dict[int, Dict[str, Any]]) -> List[Straggler]:
    """The slowest rank of each phase over the steps every rank holds complete, slowest first."""
    if len(by_rank) < 2:
        return []
    per_rank: Dict[str, Dict[int, Dict[int, float]]] = {}  # phase -> rank -> step -> seconds
    for rank, dump in by_rank.items():
        for entry in dump.get("phases", []):
            if entry["end"] is not None:
                steps = per_rank.setdefault(entry["phase"], {}).setdefault(rank, {})
                steps[entry["step"]] = steps.get(entry["step"], 0.0) + entry["end"] - entry["start"]
    found = []
    for phase, ranks in per_rank.items():
        if len(ranks) < len(by_rank):
            continue
        common = set.intersection(*(set(steps) for steps in ranks.values()))
        if not common:
            continue
        totals = {r: sum(steps[s] for s in common) for r, steps in ranks.items()}
        slowest = max(totals, key=lambda r: (totals[r], -r))
        others = statistics.median(t for r, t in totals.items() if r != slowest)
        ratio = totals[slowest] / others if others > 0 else float("inf")
        found.append(Straggler(phase, slowest, ratio, totals[slowest], others, len(common)))
    return sorted(found, key=lambda s: -s.ratio)


def _open_phases(by_rank: Dict[int, Dict[str, Any]]) -> Dict[int, Tuple[str, int, float]]:
    """Each rank's phase in progress at its dump: (phase, step, seconds in it)."""
    found = {}
    for rank, dump in by_rank.items():
        phases = dump.get("phases", [])
        if phases and phases[-1]["end"] is None:
            last = phases[-1]
            found[rank] = (last["phase"], last["step"], dump["written"] - last["start"])
    return found


def _set_name(key: str) -> str:
    return "the global process set" if key == "0" else f"process set {key}"


def _short(entry: Dict[str, Any]) -> str:
    return repr(entry["name"]) if entry["name"] is not None else entry["op"]


def _describe(entry: Optional[Dict[str, Any]], shape: bool = False) -> str:
    if entry is None:
        return "nothing"
    text = entry["op"] + (f" {entry['name']!r}" if entry["name"] is not None else "")
    if shape:
        text += f" of shape {entry.get('shape')} {entry.get('dtype')}"
    return text


def _ranks(ranks: List[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
