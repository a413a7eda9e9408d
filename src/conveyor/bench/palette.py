"""The batch timeline's cell categories and colours: one source for the PNG plots
(`bench/plots.py`) and the web page's live view (sent in its events stream's first event).

No matplotlib here: the server imports this module.
"""

from __future__ import annotations

# Timeline cell categories: (value in the matrix, legend label, colour).
IDLE, WAITING, PREFILL, DECODE, PREEMPTED, STALLED = range(6)
CATEGORIES = (
    (IDLE, "not arrived / finished", "#ffffff"),
    (WAITING, "waiting", "#d9d9d9"),
    (PREFILL, "prefill", "#1f77b4"),
    (DECODE, "decode", "#2ca02c"),
    (PREEMPTED, "preempted", "#d62728"),
    (STALLED, "running, not scheduled", "#ff7f0e"),
)
