"""The sweep's outcomes as the markdown page docs/reference/hf-families.md: counts per layout (equal,
refused by reason, differs, error), every case that differs or failed, and the family x layout
table. Imports no torch."""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

from hvdtrain.verify.outcome import Outcome

# A (family, layout) takes its worst optimizer's result: one optimizer's silent difference is enough.
SEVERITY = {"differs": 0, "error": 1, "refused": 2, "skipped": 3, "equal": 4}


def cell_results(outcomes: Iterable[Outcome]) -> Dict[Tuple[str, str], List[Outcome]]:
    cells: Dict[Tuple[str, str], List[Outcome]] = OrderedDict()
    for outcome in outcomes:
        cells.setdefault((outcome.family, outcome.layout), []).append(outcome)
    return cells


def worst(outcomes: Sequence[Outcome]) -> Outcome:
    return min(outcomes, key=lambda o: SEVERITY[o.result])


def counts(outcomes: Iterable[Outcome], layouts: Sequence[str], families: Iterable[str] = ()) -> Dict[str, Counter]:
    """Per layout: how many (family, layout) ended each way (refusals as 'refused: reason');
    ``families``: only these."""
    only = set(families)
    per_layout: Dict[str, Counter] = {layout: Counter() for layout in layouts}
    for (family, layout), cell in cell_results(outcomes).items():
        if layout in per_layout and (not only or family in only):
            end = worst(cell)
            per_layout[layout][f"refused: {end.reason}" if end.result == "refused" else end.result] += 1
    return per_layout


def markdown(outcomes: List[Outcome], layouts: Sequence[str], plans: Mapping[str, str], header: Mapping[str, str],
             built: Iterable[str] = ()) -> str:
    """The page.

    Args:
        outcomes: every case's outcome.
        layouts: the layouts' names, the table's columns.
        plans: each family's plans ("tp+pp", "tp", "pp", "no plan"), in the sweep's order.
        header: what the sweep ran on (versions, date, branch, sizes).
        built: the families that could be built tiny.
    """
    lines = ["# Hugging Face decoder families under every layout", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items()] + [""]
    lines += _summary(outcomes, layouts, plans, set(built)) + [""]
    lines += _counts_table(outcomes, layouts, plans) + [""]
    lines += _failures(outcomes) + [""]
    lines += _family_table(outcomes, layouts, plans) + [""]
    return "\n".join(lines)


def _summary(outcomes, layouts, plans, built) -> List[str]:
    tp = [f for f, p in plans.items() if "tp" in p]
    pp = [f for f, p in plans.items() if "pp" in p]
    lines = ["## Goals", "", "| | families | built tiny | equal | share of the families | share of those built |",
             "|---|---|---|---|---|---|"]
    for label, layout, group in (("with a tp plan, T=2", "T2", tp), ("with a pp plan, P=2", "P2", pp)):
        if layout in layouts and group:
            equal = counts(outcomes, [layout], group)[layout]["equal"]
            made = len([f for f in group if f in built]) or 1
            lines.append(f"| {label} | {len(group)} | {made} | {equal} | {100 * equal / len(group):.0f}% | "
                         f"{100 * equal / made:.0f}% |")
    silent = sum(1 for cell in cell_results(outcomes).values() if worst(cell).result == "differs")
    lines += ["", f"(Family, layout) pairs that trained and differ from one process: **{silent}**."]
    return lines


def _counts_table(outcomes, layouts, plans) -> List[str]:
    per_layout = counts(outcomes, layouts)
    reasons = sorted({key for c in per_layout.values() for key in c if key.startswith("refused: ")})
    columns = ["equal", *reasons, "differs", "error", "skipped"]
    lines = ["## Counts per layout", "",
             "Each (family, layout) counted once, by its worse optimizer (AdamW or SGD). `skipped`: the "
             "family could not be built tiny (the reason is in the table below).", "",
             "| layout | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for layout in layouts:
        lines.append(f"| {layout} | " + " | ".join(str(per_layout[layout][c]) for c in columns) + " |")
    return lines


def _failures(outcomes) -> List[str]:
    bad = [o for o in outcomes if o.result in ("differs", "error")]
    lines = ["## Every case that differs or failed", ""]
    if not bad:
        return lines + ["None."]
    lines += ["| family | layout | optimizer | result | max \\|diff\\| | first parameter (its \\|diff\\|, its size) or message |",
              "|---|---|---|---|---|---|"]
    for o in bad:
        where = (f"`{o.parameter}` ({o.parameter_diff:.1e}, {o.parameter_size:.1e})" if o.parameter
                 else f"per-step loss {o.loss_diff:.1e}" if o.result == "differs" else _escape(o.message or ""))
        diff = f"{o.max_diff:.1e}" if o.max_diff is not None else ""
        lines.append(f"| {o.family} | {o.layout} | {o.optimizer} | {o.result} | {diff} | {where} |")
    return lines


def _family_table(outcomes, layouts, plans) -> List[str]:
    cells = cell_results(outcomes)
    lines = ["## Every family", "", "| family | plans | " + " | ".join(layouts) + " | not built because |",
             "|---" * (len(layouts) + 3) + "|"]
    for family, plan in plans.items():
        row = [cells.get((family, layout), []) for layout in layouts]
        skipped = next((o.reason for cell in row for o in cell if o.result == "skipped"), "")
        texts = ["" if not cell else "" if worst(cell).result == "skipped" else _cell_text(cell) for cell in row]
        lines.append(f"| {family} | {plan} | " + " | ".join(texts) + f" | {_escape(skipped)} |")
    return lines


def _cell_text(cell: Sequence[Outcome]) -> str:
    end = worst(cell)
    if end.result == "equal":
        return f"equal ({max(o.max_diff for o in cell):.0e})"
    if end.result == "refused":
        return f"refused: {end.reason}"
    if end.result == "differs":
        which = "/".join(o.optimizer for o in cell if o.result == "differs")
        return f"**differs** {end.max_diff:.0e} ({which})"
    return f"**error** ({end.optimizer})"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]
