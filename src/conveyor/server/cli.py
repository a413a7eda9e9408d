"""`conveyor serve`: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from conveyor.cli.engine_args import add_dataclass_flags, add_engine_args, engine_args_from
from conveyor.config import EngineArgs
from conveyor.deploy.config import DeployConfig
from conveyor.server.config import ServerConfig

logger = logging.getLogger(__name__)

_HELP = {
    "host": "address to bind",
    "port": "port to bind",
    "api_key": "require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on /v1/*, "
               "/tokenize, /detokenize and /stats (default: $CONVEYOR_API_KEY, else no key)",
    "max_queued_requests": "answer 429 (Retry-After) once this many requests wait beyond the "
                           "free sequence slots (default: unbounded)",
    "max_request_body_bytes": "largest request body accepted",
    "shutdown_timeout": "seconds in-flight requests may take to finish after SIGTERM/SIGINT; "
                        "then they end with an error (a second signal exits at once)",
    "timeout_keep_alive": "seconds an open connection may sit without a request",
    "timeout_read_headers": "seconds a request's headers may take to arrive (slowloris)",
    "timeout_read_body": "seconds a request's body may take to arrive after its headers",
    "disable_log_requests": "no access log line per request",
    "uvicorn_log_level": "uvicorn's own log level",
    "web_ui": "serve the web page at / (chat, live engine view) and /v1/engine/events, "
              "/v1/engine/load (--no-web-ui: none of it)",
    "tool_call_parser": "how tool calls are read out of the model's text: hermes "
                        "(<tool_call>{...}</tool_call>: Qwen, Hermes), llama3_json "
                        "({\"name\": ..., \"parameters\": ...}: Llama 3.1-3.3) or "
                        "mistral ([TOOL_CALLS]...); needed for tool_choice auto",
    "reasoning_parser": "how a reasoning model's thinking is returned apart from its answer "
                        "(message.reasoning): auto (<think>...</think> where the model has "
                        "them), none (left in the text), deepseek_r1 or qwen3",
    "structured_outputs_in_reasoning": "a constraint (response_format, a forced tool call) "
                                       "applies to the thinking too, not only to the answer "
                                       "after it",
}


_DEPLOY_HELP = {
    "replicas": "run N engine replicas on Ray Serve behind this one endpoint (needs "
                "pip install -e '.[ray]'; unset: one engine in this process)",
    "routing": "with --replicas: pow2 (Ray Serve's power of two choices) or prefix (requests "
               "sharing a prompt prefix go to the replica that cached it)",
    "routing_imbalance_threshold": "with --routing prefix: queue-length gap (requests) past "
                                   "which prefix affinity yields to power of two choices",
    "ray_address": "with --replicas: join this Ray cluster ('auto': the one running here, "
                   "'host:port' of its head, 'ray://host:port'); "
                   "unset: start a local one",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag beside --tool-call-parser: accepted, and needs it "
                        '(tool_choice "auto" needs only --tool-call-parser here)')
    add_dataclass_flags(p.add_argument_group("server"), ServerConfig, _HELP)
    add_dataclass_flags(p.add_argument_group("replicas (Ray Serve)"), DeployConfig,
                        _DEPLOY_HELP)
    p.set_defaults(api_key=os.environ.get("CONVEYOR_API_KEY"))
    add_engine_args(p)
    p.set_defaults(func=run)


def server_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The flags as EngineArgs, with the server's token budget unless one is given."""
    tag = getattr(args, "model_tag", None)
    names = args.served_model_name
    if tag is None and args.model is None and isinstance(names, list) and len(names) > 1 \
            and os.path.exists(names[-1]):
        raise ValueError(f"--served-model-name took {names[-1]!r}, which is a path: give "
                         "the model first (conveyor serve MODEL --served-model-name NAME)")
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    return engine_args_from(args).for_server()


def server_config(args: argparse.Namespace) -> ServerConfig:
    if getattr(args, "enable_auto_tool_choice", False) and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    return ServerConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(ServerConfig)})


def deploy_config(args: argparse.Namespace) -> DeployConfig:
    return DeployConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(DeployConfig)})


def run(args: argparse.Namespace) -> int:
    from conveyor.server.logs import LogQueue

    config = server_config(args)
    replicas = deploy_config(args)
    if replicas.replicas is not None:
        from conveyor.deploy import RayNotInstalledError, serve_replicas

        try:
            return serve_replicas(server_engine_args(args), config, replicas)
        except RayNotInstalledError as e:
            print(f"conveyor: error: {e}", file=sys.stderr)
            return 2
    logs = LogQueue()  # from here on, nothing writes logs on the event-loop thread
    try:
        status = _serve(args, config)
    finally:
        flushed = logs.close()
    if not flushed:
        # The log output is blocked (a pipe nobody reads): the interpreter's exit would
        # block on it too, flushing its handlers and streams.
        os._exit(status)
    return status


def check_address(host: str, port: int) -> None:
    """ValueError naming --host or --port unless the server could listen there: checked
    before the model loads, not after (port 0, any free port, is not checked)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror or e}") from None
    if port == 0:
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"--port {port} on {host}: {e.strerror or e} (another server "
                             "there?)") from None


def _serve(args: argparse.Namespace, config: ServerConfig) -> int:
    import uvicorn

    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.server.app import build_app
    from conveyor.server.connections import ReadTimeouts, timed_protocol
    from conveyor.server.lifecycle import GracefulServer, freeze_start_up_heap

    # Build the engine off the main thread, whose OpenMP workers would otherwise outlive the
    # load beside the engine loop's: with more OpenMP threads than cores libgomp stops
    # spin-waiting and every kernel call of a step waits (ops/openmp.py; the engine also
    # gives the loading thread's pool back, and a thread that ends takes its own along).
    check_address(config.host, config.port)
    with ThreadPoolExecutor(max_workers=1) as pool:
        llm_engine = pool.submit(LLMEngine, server_engine_args(args)).result()  # logs KV capacity
    engine = AsyncEngine(llm_engine, max_queued_requests=config.max_queued_requests)
    app = build_app(engine, config)
    protocol = timed_protocol(ReadTimeouts(config.timeout_read_headers,
                                           config.timeout_read_body))
    # log_config=None: uvicorn's loggers get no handlers of their own and propagate to the
    # root logger's queue; access lines come from conveyor's middleware (with durations).
    # loop="asyncio": the loop the server was built and tested on, also where uvloop is
    # installed (Ray Serve, the '.[ray]' extra, brings it).
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, http=protocol,
                                    loop="asyncio", log_config=None, access_log=False,
                                    log_level=config.uvicorn_log_level.lower(),
                                    timeout_keep_alive=config.timeout_keep_alive)
    server = GracefulServer(uvicorn_config, engine, config.shutdown_timeout)

    def on_engine_dead(error: BaseException) -> None:
        # Never a server that accepts requests it will never answer: stop, exit non-zero.
        logger.error("the engine cannot continue; the server shuts down")
        server.should_exit = True

    engine.on_dead = on_engine_dead
    freeze_start_up_heap()
    try:
        server.run()
    finally:
        llm_engine.shutdown()  # tensor-parallel workers, if any
    return 0 if server.started and engine.dead_error is None else 1
