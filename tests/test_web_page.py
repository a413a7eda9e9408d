"""The web page at / in real browsers against a real `conveyor serve` with the default
model. Headless chromium (through Playwright): a streamed chat answer, the stop button
aborting the request on the server, the load button's burst seen batched in the live view,
every control reached and a question sent and stopped by keyboard, the API key asked once.
Headless Firefox (through Marionette): the streamed answer and the burst. A failing chromium
test leaves a screenshot of the page in its tmp dir (the error says where).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_fixtures import ServerProcess, metric_value, start_server, wait_idle
from web_fixtures import browser_page, firefox_session, screenshot_on_failure

pytestmark = pytest.mark.slow  # loads the default model

LAST_ANSWER = "#messages .msg.assistant:last-child"
# The answer the stop tests interrupt: greedy SmolLM2 writes the dragon story to this length
# without an EOS (~10 s on two cores), long past what a loaded browser takes to press Stop.
STORY_TOKENS = 1500
# Greedy SmolLM2-135M-Instruct: "The capital of France is Paris. It's a city steeped in history
# and ...", 40 tokens and more. (An 8-token answer could reach a loaded browser in one render,
# which the streaming checks would take for an answer that arrived whole.)
QUESTION = "What is the capital of France, and what is it famous for?"
# Records every text the newest answer shows, to tell a streamed answer from one that
# arrives whole.
WATCH_ANSWER = """() => {
  window.answerTexts = [];
  new MutationObserver(() => {
    const text = document.querySelector('ANSWER .text');
    if (text) window.answerTexts.push(text.textContent);
  }).observe(document.getElementById('messages'),
             {subtree: true, childList: true, characterData: true});
}""".replace("ANSWER", LAST_ANSWER)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # (room for the stop tests' long answers: 1500 greedy tokens, ~10 s, no EOS before)
    proc = start_server("--max-model-len", "2048", "--kv-cache-memory", "64MiB")
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()
        proc.remove_log()


@pytest.fixture(scope="module")
def page(server: ServerProcess) -> Iterator[Any]:
    with browser_page() as page:
        page.goto(server.base_url + "/")
        page.wait_for_function("m => document.getElementById('model').textContent === m",
                               arg=server.model)
        yield page


def running(server: ServerProcess) -> float:
    return metric_value(httpx.get(server.base_url + "/metrics").text,
                        "conveyor:num_requests_running")


def ask(page: Any, question: str, max_tokens: int) -> None:
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.click("#settings summary")
    page.evaluate(WATCH_ANSWER)
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def test_a_chat_answer_streams_in(page: Any, server: ServerProcess, tmp_path: Any) -> None:
    with screenshot_on_failure(page, tmp_path, "chat"):
        ask(page, QUESTION, 40)
        page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .stats')"
                               "?.textContent.includes('tokens')")
        answer = page.inner_text(f"{LAST_ANSWER} .text")
        assert "Paris" in answer
        partial = {t for t in page.evaluate("window.answerTexts") if t and t != answer}
        assert partial, "the answer appeared whole, not streamed"
        assert all(answer.startswith(t) for t in partial)
        stats = page.inner_text(f"{LAST_ANSWER} .stats")
        assert re.search(r"\d+ tokens · [\d.]+ tok/s · TTFT \d+ ms", stats), stats
        page.reload()  # the conversation is kept in local storage
        page.wait_for_selector(LAST_ANSWER)
        assert page.inner_text(f"{LAST_ANSWER} .text") == answer
        page.click("#new-chat")
        assert page.locator("#messages .msg").count() == 0
        wait_idle(server)


def test_stop_aborts_the_request_on_the_server(page: Any, server: ServerProcess,
                                               tmp_path: Any) -> None:
    with screenshot_on_failure(page, tmp_path, "stop"):
        page.click("#new-chat")  # a fresh conversation whatever the test before left
        ask(page, "Write a long story about a dragon who learns to sail.", STORY_TOKENS)
        # Stop as soon as the server runs it. A 200-token answer (~1.5 s) ended in CI before a
        # loaded browser had shown 20 characters of it, and once before Stop was clicked.
        deadline = time.monotonic() + 60
        while not running(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running(server) == 1
        page.click("#stop")
        deadline = time.monotonic() + 10
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(server) == 0
        stats = page.inner_text(f"{LAST_ANSWER} .stats")
        assert "stopped" in stats
        assert int(stats.split()[0]) < STORY_TOKENS
        metrics = wait_idle(server)
        assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0


def test_the_load_button_shows_requests_batched(page: Any, server: ServerProcess,
                                                tmp_path: Any) -> None:
    with screenshot_on_failure(page, tmp_path, "load"):
        page.fill("#load-n", "6")
        page.fill("#load-max-tokens", "12")  # the long ones would take minutes on 2 busy cores
        page.click("#load")
        page.wait_for_function("() => document.getElementById('load-status').textContent"
                               " === '6 requests sent'")
        page.wait_for_function("() => Number(document.getElementById('peak-batch')"
                               ".textContent) >= 2")
        drawn = page.evaluate("""() => {
          const c = document.getElementById('timeline');
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 3; i < d.length; i += 4) n += d[i] > 0;
          return n;
        }""")
        assert drawn > 0, "the timeline drew nothing"
        metrics = wait_idle(server, timeout_s=300)
        assert metric_value(metrics, "conveyor:num_requests_running") == 0
        assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0
        page.wait_for_function("() => document.getElementById('running').textContent === '0'")


def test_the_load_button_says_when_the_server_is_unreachable(page: Any,
                                                           tmp_path: Any) -> None:
    """A network failure (no HTTP answer at all) ends the "sending..." status with why."""
    with screenshot_on_failure(page, tmp_path, "load-offline"):
        page.route("**/v1/engine/load", lambda route: route.abort("connectionrefused"))
        try:
            page.fill("#load-n", "1")
            page.click("#load")
            page.wait_for_function("() => document.getElementById('load-status').textContent"
                                   ".startsWith('could not reach the server')")
        finally:
            page.unroute("**/v1/engine/load")


def test_a_second_question_while_the_model_is_fetched_is_not_sent(page: Any,
                                                                  server: ServerProcess,
                                                                  tmp_path: Any) -> None:
    """The page learns the model's name before its first question. A question sent while
    that lookup is under way (the first lookup found no server) makes the page busy: a second
    Enter meanwhile sends nothing, and one chat request goes out."""
    completions: list[str] = []
    held: list[Any] = []

    def count(request: Any) -> None:
        if request.url.endswith("/v1/chat/completions"):
            completions.append(request.url)

    with screenshot_on_failure(page, tmp_path, "model-refetch"):
        page.route("**/v1/models", lambda route: route.abort("connectionrefused"))
        with page.expect_event("requestfailed",
                               predicate=lambda r: r.url.endswith("/v1/models")):
            page.reload()
        model_text = page.inner_text("#model")
        page.unroute("**/v1/models")
        page.route("**/v1/models", lambda route: held.append(route))  # answered after 2 Enters
        page.on("request", count)
        try:
            page.click("#new-chat")
            page.fill("#prompt", "Say hi.")
            page.press("#prompt", "Enter")
            page.wait_for_function("() => document.getElementById('send').disabled")
            page.fill("#prompt", "Say hello.")
            page.press("#prompt", "Enter")
            page.wait_for_timeout(300)
            assert len(held) == 1
            held[0].continue_()
            page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .stats')"
                                   "?.textContent.includes('tokens')")
            assert len(completions) == 1
            assert page.locator("#messages .msg.user").count() == 1
            assert model_text.startswith("could not reach the server"), model_text
        finally:
            page.remove_listener("request", count)
            page.unroute("**/v1/models")
            page.reload()
            page.wait_for_function("m => document.getElementById('model').textContent === m",
                                   arg=server.model)
    wait_idle(server)


def test_the_page_is_usable_by_keyboard(page: Any, server: ServerProcess,
                                        tmp_path: Any) -> None:
    """Tab reaches every control (the settings and the load button included); a question
    typed and sent with Enter streams in, and Escape stops it on the server."""
    with screenshot_on_failure(page, tmp_path, "keyboard"):
        page.goto(server.base_url + "/")
        page.wait_for_function("m => document.getElementById('model').textContent === m",
                               arg=server.model)
        page.evaluate("document.activeElement.blur()")
        reached = []
        for _ in range(40):
            page.keyboard.press("Tab")
            reached.append(page.evaluate("document.activeElement.id || "
                                         "document.activeElement.tagName"))
        assert {"key-button", "prompt", "send", "new-chat", "SUMMARY", "load", "load-n",
                "load-max-tokens"} <= set(reached), reached
        def focus(element_id: str) -> None:
            for _ in range(40):
                if page.evaluate("document.activeElement.id") == element_id:
                    return
                page.keyboard.press("Shift+Tab")
            raise AssertionError(f"Shift+Tab never reached #{element_id}")

        focus("new-chat")  # (the conversation of the tests before is kept)
        page.keyboard.press("Enter")
        assert page.locator("#messages .msg").count() == 0
        focus("prompt")
        page.keyboard.type("Write a long story about a dragon who learns to sail.")
        page.keyboard.press("Enter")
        page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .text')"
                               "?.textContent.length > 20")
        assert running(server) == 1
        page.keyboard.press("Escape")
        deadline = time.monotonic() + 10
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(server) == 0
        assert "stopped" in page.inner_text(f"{LAST_ANSWER} .stats")
        wait_idle(server)


def test_escape_in_the_key_dialog_leaves_the_answer_streaming(page: Any, server: ServerProcess,
                                                             tmp_path: Any) -> None:
    with screenshot_on_failure(page, tmp_path, "key-escape"):
        page.click("#new-chat")
        ask(page, "Write a long story about a dragon who learns to sail.", 120)
        page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .text')"
                               "?.textContent.length > 5")
        page.click("#key-button")
        page.press("#key-input", "Escape")
        page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .stats')"
                               "?.textContent.includes('tokens')")
        assert "stopped" not in page.inner_text(f"{LAST_ANSWER} .stats")
        wait_idle(server)


def test_the_page_asks_for_the_api_key_once(page: Any, server: ServerProcess,
                                            tiny_llama_dir: Any, tmp_path: Any) -> None:
    keyed = start_server("--model", str(tiny_llama_dir), "--dtype", "float32",
                         "--kv-cache-memory", "1MiB", "--api-key", "page-key",
                         api_key="page-key")
    try:
        # Another port, another origin: nothing in local storage for it yet.
        with screenshot_on_failure(page, tmp_path, "key"):
            page.goto(keyed.base_url + "/")
            page.wait_for_selector("#key-dialog[open]")
            page.fill("#key-input", "page-key")
            page.click("#key-save")
            page.wait_for_function("m => document.getElementById('model').textContent === m",
                                   arg=keyed.model)
            page.wait_for_function("() => document.getElementById('live-status').textContent"
                                   " === '(live)'")
            # Dismissed after that Save (Escape; requestClose, the close-watcher path that
            # keeps the dialog's last returnValue), the dialog saves nothing that was typed
            for dismiss in ("Escape", "requestClose"):
                page.click("#key-button")
                page.fill("#key-input", "abandoned")
                if dismiss == "Escape":
                    page.press("#key-input", "Escape")
                else:
                    page.evaluate("() => document.getElementById('key-dialog').requestClose()")
                page.wait_for_selector("#key-dialog", state="hidden")
                stored = page.evaluate("() => localStorage.getItem('conveyor.apiKey')")
                assert stored == "page-key", dismiss
            page.reload()  # the key is kept: no second question
            page.wait_for_function("() => document.getElementById('live-status').textContent"
                                   " === '(live)'")
            assert not page.is_visible("#key-dialog")
    finally:
        page.goto(server.base_url + "/")  # the module's page, back on its server
        assert keyed.stop() == 0, keyed.log_tail()
        keyed.remove_log()


# ---------------------------------------------------------------- Firefox
def firefox_wait(client: Any, script: str, timeout_s: float = 180) -> Any:
    """Poll ``script`` (a JS function body returning a value) until it is truthy."""
    from marionette_driver import Wait

    return Wait(client, timeout=timeout_s, interval=0.05).until(
        lambda c: c.execute_script(script), message=script)


def test_firefox_streams_an_answer_and_shows_the_burst(server: ServerProcess,
                                                       tmp_path: Any) -> None:
    from marionette_driver import By
    from marionette_driver.keys import Keys

    with firefox_session(tmp_path) as client:
        client.navigate(server.base_url + "/")
        firefox_wait(client, "return document.getElementById('model').textContent === "
                             f"{server.model!r}")
        client.find_element(By.CSS_SELECTOR, "#settings summary").click()
        for field, value in (("#temperature", "0"), ("#max-tokens", "40")):
            element = client.find_element(By.CSS_SELECTOR, field)
            element.clear()
            element.send_keys(value)
        client.find_element(By.CSS_SELECTOR, "#settings summary").click()
        # (in the page's own scope, not a sandbox: window.answerTexts persists)
        client.execute_script(WATCH_ANSWER.replace("() => {", "(() => {", 1) + ")();",
                              sandbox=None)
        prompt = client.find_element(By.CSS_SELECTOR, "#prompt")
        prompt.send_keys(QUESTION)
        prompt.send_keys(Keys.ENTER)
        firefox_wait(client, f"return document.querySelector('{LAST_ANSWER} .stats')"
                             "?.textContent.includes('tokens')")
        answer = client.execute_script(
            f"return document.querySelector('{LAST_ANSWER} .text').textContent")
        assert "Paris" in answer
        partial = {t for t in client.execute_script("return window.answerTexts", sandbox=None)
                   if t and t != answer}
        assert partial and all(answer.startswith(t) for t in partial), partial
        wait_idle(server)
        for field, value in (("#load-n", "6"), ("#load-max-tokens", "12")):
            element = client.find_element(By.CSS_SELECTOR, field)
            element.clear()
            element.send_keys(value)
        client.find_element(By.CSS_SELECTOR, "#load").click()
        firefox_wait(client, "return Number(document.getElementById('peak-batch')"
                             ".textContent) >= 2")
        metrics = wait_idle(server, timeout_s=300)
        assert metric_value(metrics, "conveyor:kv_cache_usage_perc") == 0


def test_the_thinking_shows_above_the_answer(page: Any, server: ServerProcess,
                                             tmp_path: Any) -> None:
    """A reasoning model's thinking (here the default model's words, as a template that
    opens <think> makes them: the parser reads all of them as thinking) streams into the
    answer's thinking line, not its text, and is kept on reload. (The module's page, one
    browser a process, visits a second server, then comes back.)"""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
                "\n<think>\n{% endif %}")
    thinking = start_server("--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                            "--reasoning-parser", "deepseek_r1", "--chat-template", template)
    try:
        expected = httpx.post(thinking.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 12}).json()["choices"][0]["message"]
        assert expected["reasoning"] and expected["content"] is None, expected
        with screenshot_on_failure(page, tmp_path, "thinking"):
            page.goto(thinking.base_url + "/")
            page.wait_for_function("m => document.getElementById('model').textContent === m",
                                   arg=thinking.model)
            ask(page, QUESTION, 12)
            page.wait_for_function(f"() => document.querySelector('{LAST_ANSWER} .stats')"
                                   "?.textContent.includes('tokens')")
            assert page.inner_text(f"{LAST_ANSWER} .thinking").strip() == \
                expected["reasoning"].strip()
            assert page.inner_text(f"{LAST_ANSWER} .text") == ""
            page.reload()
            page.wait_for_selector(LAST_ANSWER)
            assert page.inner_text(f"{LAST_ANSWER} .thinking").strip() == \
                expected["reasoning"].strip()
        wait_idle(thinking)
    finally:
        page.goto(server.base_url + "/")
        page.wait_for_function("m => document.getElementById('model').textContent === m",
                               arg=server.model)
        assert thinking.stop() == 0, thinking.log_tail()
        thinking.remove_log()
