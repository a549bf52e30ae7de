"""The stall report: plain records of every rank in, a short readable text out (pure).

A record is what one rank answers (see ``pdist._stall.local_record``):
``rank``, ``host``, ``stack`` (``[file, line, function]``, innermost first),
``site`` (the innermost frame outside torch and pdist) and ``groups``: per
group a ``key`` (torch's group name, the same on every member), a ``label``
(``world``, ``tp``...), ``enqueued`` and ``completed`` sequence numbers, the
oldest collective ``inflight`` and the ``last`` completed one (each ``seq``,
``op``, ``sizes``, ``dtypes``, ``age`` in seconds). Nothing here touches
torch or a process, so every rule is tested on synthetic records.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["format_ranks", "format_report", "frame_text", "picture", "stalled"]

_SHOWN_GROUPS, _SHOWN_LINES, _SHOWN_STACKS, _SHOWN_FRAMES = 6, 4, 6, 12
_HINTS = (
    "  hints: ranks in different collectives, or in one with different shapes or dtypes (the "
    "DESYNC above): rerun with check mode (pdist.distributed(check=True) or PDIST_CHECK=1), "
    "which makes every rank raise naming each rank's call; for raw torch.distributed calls set "
    "TORCH_DISTRIBUTED_DEBUG=DETAIL before entering distributed()"
)


def format_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    """Ranks as sorted ranges, ``"0-6, 8-8191"``; past ``limit`` ranges, a count ends it."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "none"
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (f", ... ({len(ordered)} ranks in all)" if len(runs) > limit else "")


def _who(ranks: Sequence[int]) -> str:
    n = len(set(ranks))
    text = format_ranks(ranks)
    count = f" ({n} ranks)" if n > 8 and "," in text and "in all" not in text else ""
    return f"{'rank' if n == 1 else 'ranks'} {text}{count}"


def _op_text(op: dict[str, Any]) -> str:
    sizes = ",".join(str(s) for s in op.get("sizes", []))
    dtypes = ",".join(sorted(set(op.get("dtypes", [])) - {""}))
    return " ".join(t for t in (f"{op.get('op', '?')} #{op.get('seq', '?')}", sizes, dtypes) if t)


def frame_text(frame: Sequence[Any]) -> str:
    """A frame as ``file:line in function``."""
    return f"{frame[0]}:{frame[1]} in {frame[2]}"


def _signature_lines(members: list[tuple[int, dict[str, Any], str]]) -> list[str]:
    """Who waits in which collective of one group, and the ranks at one seq that disagree."""
    waiting: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    by_seq: dict[Any, set[str]] = defaultdict(set)
    for rank, group, site in members:
        op = group["inflight"]
        if op is not None:
            waiting[_op_text(op)].append((rank, float(op.get("age", 0.0)), site))
            by_seq[op.get("seq")].add(_op_text(op))
    lines = []
    for text, who in sorted(waiting.items(), key=lambda kv: -max(a for _, a, _ in kv[1])):
        sites = {s for _, _, s in who}
        where = f", called from {sites.pop()}" if len(sites) == 1 else " (call sites: see stacks)"
        age = max(a for _, a, _ in who)
        lines.append(f"    {_who([r for r, _, _ in who])} in {text}, waiting {age:.1f}s{where}")
    for seq, texts in sorted(by_seq.items(), key=lambda kv: str(kv[0])):
        if len(texts) > 1:
            parts = [f"{_who([r for r, _, _ in waiting[t]])}: {t}" for t in sorted(texts)]
            lines.append(f"    DESYNC at #{seq}: " + " | ".join(parts))
    return lines[: _SHOWN_LINES * 2]


def _behind_lines(members: list[tuple[int, dict[str, Any], str]]) -> list[str]:
    """The ranks of one group that have not entered its oldest waiting collective."""
    front = min(g["inflight"]["seq"] for _, g, _ in members if g["inflight"] is not None)
    behind: dict[str, list[int]] = defaultdict(list)
    for rank, group, _ in members:
        enqueued = group.get("enqueued")
        if group["inflight"] is None and isinstance(enqueued, int) and enqueued < front:
            last = group.get("last")
            behind[_op_text(last) if last else "none"].append(rank)
    return [
        f"    {_who(ranks)} not entered #{front}; last completed {text}"
        for text, ranks in sorted(behind.items(), key=lambda kv: kv[1][0])
    ][:_SHOWN_LINES]


def _group_section(records: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[tuple[int, dict[str, Any], str]]] = defaultdict(list)
    for rec in records:
        for group in rec["groups"]:
            groups[group["key"]].append((rec["rank"], group, rec.get("site", "?")))
    busy = [k for k, members in groups.items() if any(g["inflight"] for _, g, _ in members)]
    busy.sort(key=lambda k: -max(g["inflight"]["age"] for _, g, _ in groups[k] if g["inflight"]))
    lines = []
    for key in busy[:_SHOWN_GROUPS]:
        members = groups[key]
        label, source = members[0][1].get("label", key), members[0][1].get("source", "")
        where = f"pg {key[:12]}, {source}" if source == "flight recorder" else source
        lines.append(f"  group {label} ({where}), {_who([r for r, _, _ in members])}:")
        lines += _signature_lines(members) + _behind_lines(members)
    if len(busy) > _SHOWN_GROUPS:
        lines.append(f"  ... {len(busy) - _SHOWN_GROUPS} more groups with collectives in flight")
    return lines or ["  no group has a collective in flight any more"]


def _stack_section(records: list[dict[str, Any]]) -> list[str]:
    stacks: dict[tuple[tuple[Any, ...], ...], list[int]] = defaultdict(list)
    hosts: dict[int, str] = {}
    for rec in records:
        stacks[tuple(tuple(f) for f in rec["stack"])].append(rec["rank"])
        hosts[rec["rank"]] = str(rec.get("host", "?"))
    ordered = sorted(stacks.items(), key=lambda kv: min(kv[1]))
    lines = ["  main-thread stacks, innermost frame first:"]
    for frames, ranks in ordered[:_SHOWN_STACKS]:
        host = f" on {hosts[ranks[0]]}" if len(ranks) == 1 else ""
        lines.append(f"    {_who(ranks)}{host}:")
        lines += [f"      {frame_text(f)}" for f in frames[:_SHOWN_FRAMES]] or ["      -"]
        if len(frames) > _SHOWN_FRAMES:
            more = len(frames) - _SHOWN_FRAMES
            lines.append(f"      ... {more} outer frame{'s' if more > 1 else ''}")
    rest = [r for _, ranks in ordered[_SHOWN_STACKS:] for r in ranks]
    if rest:
        lines.append(f"    ... {len(ordered) - _SHOWN_STACKS} more distinct stacks on {_who(rest)}")
    return lines


def _oldest(records: Iterable[dict[str, Any]]) -> float:
    ages = [g["inflight"]["age"] for r in records for g in r["groups"] if g["inflight"]]
    return max(ages, default=0.0)


def format_report(
    records: list[dict[str, Any]],
    *,
    world_size: int | None = None,
    stall_timeout: float,
    round_no: int = 1,
    exit_code: int | None = None,
) -> str:
    """The stall report over every answering rank's record.

    Per group with a collective in flight: who waits in which collective, a
    desync, the ranks that have not entered it; then each distinct main-thread
    stack once, and the ranks of ``range(world_size)`` that did not answer
    (None: one rank's own view). Every section is capped, so the report stays
    short at any world size. Check mode's hint shows only under a desync: for a
    rank that never entered the collective it cannot help. ``exit_code``: the
    code the ranks exit with after the report (``on_stall="exit"``), said last.
    """
    answered = {rec["rank"] for rec in records}
    if world_size is None:
        seen = f"rank {format_ranks(answered)}'s own view (no store connection to ask the others)"
    else:
        seen = f"{len(answered)} of {world_size} ranks answered"
    groups = _group_section(records)
    lines = [
        f"pdist: stall report (round {round_no}): a collective has waited "
        f"{_oldest(records):.1f}s, past stall_timeout={stall_timeout:g}s; {seen}",
        *groups,
        *([_HINTS] if any("DESYNC at #" in line for line in groups) else []),
        *_stack_section(records),
    ]
    if world_size is not None:
        missing = format_ranks(r for r in range(world_size) if r not in answered)
        lines.append(f"  did not answer (dead, stopped, or holding the GIL): {missing}")
    if exit_code is not None:
        lines.append(
            f"  on_stall='exit': exiting with code {exit_code} on every rank that answered; "
            "have the launcher restart the job on this code"
        )
    return "\n".join(lines)


def picture(records: list[dict[str, Any]], world_size: int) -> str:
    """A digest of what a report shows, without the ages: equal when nothing moved."""
    seen = []
    for rec in sorted(records, key=lambda r: r["rank"]):
        groups = [
            [g["key"], g.get("completed"), (g["inflight"] or {}).get("seq")] for g in rec["groups"]
        ]
        seen.append([rec["rank"], groups, rec["stack"]])
    text = json.dumps([world_size, seen], separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def stalled(records: Iterable[dict[str, Any]], stall_timeout: float) -> bool:
    """Whether some record holds a collective that has waited ``stall_timeout`` or longer."""
    return _oldest(records) >= stall_timeout
