"""The web page at `/` (chat and live engine view) and the two endpoints only it needs.

- `GET /` and `GET /ui/*`: plain HTML/CSS/JS from `server/static` (no build step, nothing
  fetched from elsewhere: the page's Content-Security-Policy allows this origin only).
- `GET /v1/engine/events`: Server-Sent Events, step summaries coalesced several times a
  second (`server/events.py`).
- `POST /v1/engine/load`: a burst of the skewed workload (`bench serve --dataset skewed`)
  submitted by the server itself, so the live view can be watched without writing a client.

Both endpoints are under `/v1/`, so the API key guards them like the OpenAI routes; the page
asks for the key once and keeps it in the browser's local storage. `--no-web-ui` removes all
of this (and the step records behind it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from conveyor.bench.datasets import SkewedMix, sample_skewed_requests
from conveyor.engine.async_engine import AsyncEngine, RequestStream
from conveyor.sampling_params import RequestOutputKind, SamplingParams
from conveyor.server.events import EngineEvents

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
# Most requests one press of "load" may send.
MAX_LOAD_REQUESTS = 64
DEFAULT_LOAD_REQUESTS = 16
# The page loads only its own files: no network at run time, by construction.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "style-src 'self'; script-src 'self'; connect-src 'self'",
    "Cache-Control": "no-cache",
}


class LoadRequest(BaseModel):
    """`POST /v1/engine/load`: how big a burst of the skewed workload to send."""

    model_config = ConfigDict(extra="forbid")
    num_requests: int = Field(DEFAULT_LOAD_REQUESTS, ge=1, le=MAX_LOAD_REQUESTS)
    # Caps every request's output tokens (the mix asks 16-64, and 256 for one in five).
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None  # None: a different burst each time


class LoadResponse(BaseModel):
    request_ids: list[str]  # the requests the engine accepted (fewer when its queue is full)


class LoadBursts:
    """Submits bursts and reads them to the end in background tasks (nobody else reads)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._bursts = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def _mix(self) -> SkewedMix:
        """The skewed mix, its lengths shrunk to fit a short max_model_len (a word of its
        prompts is about one token)."""
        default, max_len = SkewedMix(), self.engine.max_model_len
        prompt_max = max(1, min(default.prompt_max, max_len // 4))
        output_max = max(1, min(default.long_output_len, max_len // 2))
        return SkewedMix(prompt_min=min(default.prompt_min, prompt_max), prompt_max=prompt_max,
                         short_output_min=min(default.short_output_min, output_max),
                         short_output_max=min(default.short_output_max, output_max),
                         long_output_len=output_max)

    async def send(self, req: LoadRequest) -> LoadResponse:
        """Submit the burst at once (one add per request would wait a step each); the
        requests the engine refuses (its queue is full) are left out, unless all are."""
        burst = next(self._bursts)
        seed = req.seed if req.seed is not None else burst
        samples = sample_skewed_requests(req.num_requests, self._mix(), seed)
        ids = [f"load-{burst}-{i}" for i in range(len(samples))]
        results = await asyncio.gather(*(
            self.engine.add_request(sample.prompt, SamplingParams(
                temperature=0.0, max_tokens=min(sample.output_len,
                                                req.max_tokens or sample.output_len),
                ignore_eos=True, output_kind=RequestOutputKind.DELTA), request_id)
            for sample, request_id in zip(samples, ids, strict=True)), return_exceptions=True)
        accepted = []
        for request_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException):
                continue
            task = asyncio.create_task(_read_to_end(result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            accepted.append(request_id)
        if not accepted:
            error = results[0]
            assert isinstance(error, BaseException)
            raise error
        return LoadResponse(request_ids=accepted)


async def _read_to_end(stream: RequestStream) -> None:
    try:
        async for _ in stream:
            pass
    except Exception as e:  # e.g. the server shut down first: nobody to tell
        logger.debug("load request %s ended: %s", stream.request_id, e)
    finally:
        stream.close()


def add_web_ui(app: FastAPI, engine: AsyncEngine, events: EngineEvents) -> None:
    """The page, its files, the events stream and the load button's endpoint."""
    bursts = LoadBursts(engine)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")

    @app.get("/v1/engine/events", response_class=StreamingResponse)
    async def engine_events() -> StreamingResponse:
        """Server-Sent Events: an `info` event, then a `steps` event every 0.2 s."""
        return StreamingResponse(events.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/engine/load", response_model=LoadResponse)
    async def engine_load(req: LoadRequest) -> LoadResponse:
        """Send a burst of the skewed workload (greedy, ignore_eos) from the server itself."""
        return await bursts.send(req)
