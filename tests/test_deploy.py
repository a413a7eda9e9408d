"""The Ray-free parts of `conveyor serve --replicas`: the prefix index, what the router
matches on, the request bridge into a replica's app, the CPU share, and the message when Ray
is missing. (The deployment itself: tests/test_ray_serve.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from conveyor.deploy.bridge import ForwardedRequest, ResponseStart, call_asgi, routing_text
from conveyor.deploy.config import DeployConfig, check_ray_address_answers, replica_cpus
from conveyor.deploy.prefix_index import PrefixIndex

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3


def test_prefix_index_finds_the_replica_with_the_longest_shared_prefix() -> None:
    index = PrefixIndex(block_chars=16)
    index.insert("a", SYSTEM + "What is the sea?")
    index.insert("b", SYSTEM[:40] + "something else entirely, long enough to fill blocks")
    best, matched = index.longest_match(SYSTEM + "Why is the sky blue?", ["a", "b"])
    assert best == "a"
    assert matched == len(SYSTEM) // 16 * 16
    assert index.longest_match("unrelated prompt text, longer than a block", ["a", "b"]) == \
        (None, 0)
    assert index.longest_match(SYSTEM, ["b"])[0] == "b"  # only the candidates count
    index.remove("a")
    assert index.longest_match(SYSTEM + "x", ["a", "b"])[0] == "b"


def test_prefix_index_is_bounded_per_replica() -> None:
    index = PrefixIndex(block_chars=8, max_blocks_per_replica=4)
    index.insert("a", "0123456789abcdef" * 4)  # 8 blocks: the first 4 are evicted
    assert index.longest_match("0123456789abcdef" * 4, ["a"]) == (None, 0)
    index.insert("a", "01234567")
    assert index.longest_match("01234567xxxxxxxx", ["a"]) == ("a", 8)


def test_the_routers_pending_reasons_are_bounded(monkeypatch) -> None:
    """A request cancelled while queued is never routed, so the reason noted for it is never
    taken: the router keeps at most MAX_PENDING_REASONS of them, the newest."""
    from conveyor.deploy import routing

    monkeypatch.setattr(routing, "MAX_PENDING_REASONS", 100, raising=False)
    router = routing.PrefixAffinityRouter.__new__(routing.PrefixAffinityRouter)
    router.initialize_state()  # (Ray Serve calls it after its own set-up)
    for i in range(250):
        request = SimpleNamespace(metadata=SimpleNamespace(request_id=f"r{i}"))
        router._note(request, "no_match")
    assert len(router._reasons) == 100
    assert next(iter(router._reasons)) == "r150" and "r249" in router._reasons


def test_the_web_pages_requests_all_go_to_the_live_views_replica() -> None:
    """`/v1/engine/*` and requests with the page's header go to one replica (the smallest
    name) under both routers; other requests are left to the router's own choice."""
    from conveyor.deploy import routing
    from conveyor.deploy.bridge import is_live_view

    assert is_live_view("/v1/engine/events", []) and is_live_view("/v1/engine/load", [])
    assert is_live_view("/v1/chat/completions", [(b"X-Conveyor-Live-View", b"1")])
    assert not is_live_view("/v1/chat/completions", [(b"content-type", b"application/json")])
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))
                for name in ("m2", "a7", "q1")]

    def pending(path: str, headers: list[tuple[bytes, bytes]]) -> SimpleNamespace:
        forwarded = ForwardedRequest("POST", path, b"", headers, b"{}",
                                     live_view=is_live_view(path, headers))
        return SimpleNamespace(args=[forwarded], metadata=SimpleNamespace(request_id="r"))

    live = pending("/v1/chat/completions", [(b"x-conveyor-live-view", b"1")])
    for cls in (routing.PowerOfTwoRouter, routing.PrefixAffinityRouter):
        router = cls.__new__(cls)
        router.initialize_state()
        for request in (live, pending("/v1/engine/load", [])):
            chosen = asyncio.run(router.choose_replicas(replicas, request))
            assert [[r.replica_id.unique_id for r in group] for group in chosen] == [["a7"]]
    assert router._reasons == {"r": "live_view"}  # (the prefix router's counter)
    assert router.live_view_replica(replicas, pending("/v1/completions", [])) is None
    assert router.live_view_replica([], live) is None

    def pinned(names: tuple[str, ...]) -> str:
        chosen = router.live_view_replica(
            [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in names], live)
        assert chosen is not None
        return chosen[0][0].replica_id.unique_id

    assert pinned(("m2", "a7", "0b")) == "a7"  # one that joins later does not take over
    assert pinned(("m2", "0b")) == "0b"  # when it is gone, the smallest of the others


def test_routing_text_reads_prompts_and_messages_in_order() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text("/v1/chat/completions", json.dumps(chat).encode()) == \
        "<system>Be brief.<user>Hi"
    assert routing_text("/v1/completions", b'{"prompt": ["one", "two"]}') == "one"
    assert routing_text("/v1/completions", b'{"prompt": [5, 6]}') == "5 6"
    assert routing_text("/v1/completions", b"not json") is None
    assert routing_text("/tokenize", b'{"prompt": "x"}') is None
    response = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    assert routing_text("/v1/responses", json.dumps(response).encode()) == \
        "<system>Be brief.<user>Hi"
    assert routing_text("/v1/responses", b'{"input": "Hi"}') == "<user>Hi"
    anthropic = {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    assert routing_text("/v1/messages", json.dumps(anthropic).encode()) == \
        "<system>Be brief.<user>Hi"


def _app() -> FastAPI:
    app = FastAPI()
    app.state.cancelled = asyncio.Event()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, str]:
        return {"got": (await request.body()).decode()}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                app.state.cancelled.set()
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _request(method: str, path: str, body: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest(method, path, b"", [(b"content-type", b"application/json")], body)


def test_bridge_answers_through_the_app_and_cuts_a_stream_when_closed() -> None:
    app = _app()

    async def run() -> None:
        pieces = [p async for p in call_asgi(app, _request("POST", "/echo", b"hello"), "r1")]
        assert len(pieces) == 1 and isinstance(pieces[0], ResponseStart)
        assert pieces[0].status == 200 and json.loads(pieces[0].body) == {"got": "hello"}
        assert pieces[0].replica == "r1" and not pieces[0].is_event_stream
        missing = [p async for p in call_asgi(app, _request("GET", "/nope"), "r1")]
        assert isinstance(missing[0], ResponseStart) and missing[0].status == 404
        stream = call_asgi(app, _request("GET", "/stream"), "r1")
        first = await stream.__anext__()
        assert isinstance(first, ResponseStart) and first.is_event_stream
        assert await stream.__anext__() == b"data: 1\n\n"
        await stream.aclose()  # the client went away: the app sees it disconnect
        await asyncio.wait_for(app.state.cancelled.wait(), 5)

    asyncio.run(run())


def test_more_replicas_than_cpus_share_them_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    assert replica_cpus(2, 2.0) == 1.0
    with caplog.at_level(logging.WARNING, "conveyor.deploy"):
        assert replica_cpus(3, 2.0) == pytest.approx(2 / 3)
    assert "3 replicas on 2 CPUs" in caplog.text


def test_deploy_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        DeployConfig(replicas=0)
    with pytest.raises(ValueError, match="routing must be one of pow2, prefix"):
        DeployConfig(routing="random")
    with pytest.raises(ValueError, match=r"ray_address \(--ray-address\) must be 'auto'"):
        DeployConfig(ray_address="head-node")
    for address in (None, "auto", "local", "10.0.0.5:6379", "ray://head:10001"):
        assert DeployConfig(replicas=1, ray_address=address).ray_address == address
    with pytest.raises(ValueError, match=r"replicas \(--replicas\) must be set"):
        DeployConfig(routing="prefix")  # it would be ignored without replicas


def test_a_ray_address_where_nothing_answers_names_the_flag() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_address = f"127.0.0.1:{listening.getsockname()[1]}"
        check_ray_address_answers(open_address)
        check_ray_address_answers("ray://" + open_address)
    with pytest.raises(ValueError, match=f"--ray-address {open_address}: no Ray cluster "
                                         "answers there"):
        check_ray_address_answers(open_address, timeout_s=2)
    check_ray_address_answers("auto")  # Ray looks that one up itself


def test_replicas_without_ray_name_the_extra_to_install() -> None:
    main = ("import sys; sys.modules['ray'] = None\n"
            "from conveyor.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", main, "serve", "--replicas", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install -e '.[ray]'" in done.stderr
