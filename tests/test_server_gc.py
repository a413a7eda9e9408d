"""`conveyor serve` freezes what start-up built (gc.freeze): the collector's full passes,
which hold the GIL and with it the engine's loop, then skip the model's, the tokenizer's and
the app's objects (docs/benchmarks.md, seventh session on Zen 4: one pass over the unfrozen
heap held a 64-stream decode for 173 ms)."""

from __future__ import annotations

import time

from server_fixtures import start_server

# Run in the server process before it starts: a thread that writes the number of frozen
# objects to a file once there are some.
PROBE = """
import gc, os, pathlib, threading, time
def _probe(path=pathlib.Path({path!r})):
    while gc.get_freeze_count() == 0:
        time.sleep(0.05)
    path.with_suffix(".tmp").write_text(str(gc.get_freeze_count()))
    os.replace(path.with_suffix(".tmp"), path)
threading.Thread(target=_probe, daemon=True).start()
"""


def test_the_server_freezes_its_start_up_heap(tmp_path) -> None:
    out = tmp_path / "frozen"
    server = start_server(setup=PROBE.format(path=str(out)))
    try:
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert out.exists(), "the server answers /health with nothing frozen"
        assert int(out.read_text()) > 50_000  # the model's, tokenizer's and app's objects
    finally:
        server.stop()
