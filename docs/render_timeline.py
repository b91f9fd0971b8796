"""Renders a merged hvdrun timeline to a PNG (docs/insight-timeline.png was made with it).

    hvdrun -np 2 --timeline-filename trace.json --timeline-all-ranks \\
        python examples/straggler.py --slow-rank 1
    python docs/render_timeline.py trace.json docs/insight-timeline.png

A development tool: it needs matplotlib (``pip install matplotlib``), which hvdrun itself
does not. One lane per rank and op, over a window of the trace (``--start``/``--seconds``;
by default 0.6 s from the middle): the NEGOTIATE phases (an op waiting for the other ranks)
in orange, the op's own phases in blue.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

PHASE_COLOURS = {"NEGOTIATE": "#f28e2b", "QUEUE": "#bab0ac"}
OP_COLOUR = "#4e79a7"
INNER_COLOUR = "#1f4e79"
Lane = tuple[int, int]  # (rank, op row)


def spans(events: list[dict[str, Any]]) -> dict[Lane, list[tuple[str, float, float]]]:
    """(rank, op row) -> (phase, start, end) in milliseconds, from the B/E pairs."""
    found: dict[Lane, list[tuple[str, float, float]]] = defaultdict(list)
    open_: dict[Lane, list[tuple[str, float]]] = defaultdict(list)
    for event in events:
        key = (event.get("pid", 0), event.get("tid", 0))
        if event.get("ph") == "B":
            open_[key].append((event["name"], event["ts"] / 1000.0))
        elif event.get("ph") == "E" and open_[key]:
            name, start = open_[key].pop()
            found[key].append((name, start, event["ts"] / 1000.0))
    return found


def threads(events: list[dict[str, Any]]) -> dict[Lane, str]:
    """(rank, op row) -> the op's name: the rows of a merged trace (none in a rank's own)."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"
    }


def outer(phase: str) -> bool:
    """A phase of its own (NEGOTIATE_*, the op): drawn full height; the others inside it."""
    return phase.startswith("NEGOTIATE") or ("_" not in phase and phase != "QUEUE")


def colour(phase: str) -> str:
    for prefix, value in PHASE_COLOURS.items():
        if phase.startswith(prefix):
            return value
    return OP_COLOUR if outer(phase) else INNER_COLOUR


class NothingToDraw(Exception):
    """The trace has nothing to draw in the window asked for (the message says why)."""


def window(
    rows: dict[Lane, str],
    found: dict[Lane, list[tuple[str, float, float]]],
    start_s: float | None,
    seconds: float,
) -> tuple[list[Lane], float, float]:
    """The lanes (``rows``, with their ``spans``) that have a phase in the window
    (``start_s``, by default the middle of the trace, and ``seconds`` on), and the window's
    start and stop in milliseconds; NothingToDraw when the trace is no merged timeline, or
    the window holds no op."""
    if not rows:
        raise NothingToDraw(
            "not a merged timeline (no rank has a row of ops): merge the ranks' timelines "
            "first, hvdrun --merge-timelines OUTPUT trace.0.json trace.1.json ..."
        )
    end = max((stop for lanes in found.values() for _, _, stop in lanes), default=0.0)
    start = start_s * 1000.0 if start_s is not None else end / 2
    stop = start + seconds * 1000.0
    lanes = sorted(
        key
        for key, items in found.items()
        if rows.get(key, "").startswith(("allreduce", "broadcast", "allgather"))
        and any(a < stop and b > start for _, a, b in items)
    )
    if not lanes:
        raise NothingToDraw(
            f"no allreduce, broadcast or allgather between {start / 1000:.3f} s and "
            f"{stop / 1000:.3f} s (the trace ends at {end / 1000:.3f} s)"
        )
    return lanes, start, stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--start", type=float, help="seconds into the trace")
    parser.add_argument("--seconds", type=float, default=0.6)
    parser.add_argument("--title", default="merged timeline: one lane per rank and op")
    args = parser.parse_args()
    with open(args.trace, encoding="utf-8") as source:
        events = json.load(source)
    rows, found = threads(events), spans(events)
    try:
        lanes, start, stop = window(rows, found, args.start, args.seconds)
    except NothingToDraw as error:
        sys.exit(f"{parser.prog}: {args.trace}: {error}; no {args.png} written")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    figure, axes = plt.subplots(figsize=(11, 0.5 * len(lanes) + 1.8))
    for y, key in enumerate(reversed(lanes)):
        for phase, a, b in sorted(found[key], key=lambda item: item[2] - item[1], reverse=True):
            if b < start or a > stop:
                continue
            height = 0.7 if outer(phase) else 0.4
            axes.broken_barh([(a - start, b - a)], (y - height / 2, height), color=colour(phase))
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"{ranks[k[0]]} · {rows[k]}" for k in reversed(lanes)], fontsize=8)
    axes.set_xlim(0, stop - start)
    axes.set_xlabel("milliseconds (clocks aligned)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=PHASE_COLOURS["NEGOTIATE"]),
        plt.Rectangle((0, 0), 1, 1, color=OP_COLOUR),
        plt.Rectangle((0, 0), 1, 1, color=INNER_COLOUR),
    ]
    labels = ["NEGOTIATE: waiting for the other ranks", "the op", "copies and the collective"]
    axes.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, ncol=3
    )
    axes.set_title(args.title, fontsize=10)
    figure.tight_layout()
    figure.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
