"""Regenerate the README's picture of the web page's live view under load, with the web
page tests' machinery (a real `conveyor serve` with the default model, headless chromium):

    PYTHONPATH=src python tests/web_screenshot.py [docs/images/live-view.png]

The load button sends a burst of the skewed workload, and three requests with n=2 share
their prompt's blocks (black in the block map); the picture is taken once the batch has
run for a while; the server then stops without waiting for the burst to finish.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import openai

from server_fixtures import start_server
from web_fixtures import browser_page

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = ROOT / "docs" / "images" / "live-view.png"
BURST = 24
SETTLE_STEPS = 40  # steps of the burst drawn before the picture


def share_a_prefix(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    prompt = "You are a helpful assistant who answers in one sentence. " * 6
    for question in ("Why is the sea blue?", "What is a haiku?", "Who wrote Hamlet?"):
        client.completions.create(model=model, prompt=prompt + question, n=2, max_tokens=48,
                                  temperature=0.8, extra_body={"ignore_eos": True})


def main(path: Path) -> None:
    server = start_server("--max-model-len", "512", "--kv-cache-memory", "128MiB",
                          "--shutdown-timeout", "1")
    try:
        with browser_page() as page:
            page.goto(server.base_url + "/")
            page.wait_for_function("() => document.getElementById('live-status').textContent"
                                   " === '(live)'")
            page.fill("#load-n", str(BURST))
            page.click("#load")
            sharing = threading.Thread(target=share_a_prefix,
                                       args=(server.base_url, server.model), daemon=True)
            sharing.start()
            page.wait_for_function("n => live.columns.length >= n", arg=SETTLE_STEPS,
                                   timeout=0)
            path.parent.mkdir(parents=True, exist_ok=True)
            page.locator("#live").screenshot(path=str(path))
            print(f"wrote {path}")
    finally:
        server.stop()
        server.remove_log()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PATH)
