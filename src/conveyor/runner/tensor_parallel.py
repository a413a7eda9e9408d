"""Tensor parallelism's processes: rank 0 in the engine's process, ranks 1..N-1 spawned.

The scheduler runs once, in the engine (rank 0's process), and never learns that the model
is split. Each step, rank 0's executor sends the step's ``SchedulerOutput`` to every other
rank (one pickle, written to one pipe per rank), with the tokens rank 0 sampled in the step
before; then every rank runs the same ``ModelRunner.execute`` on its shard, and the model's
collectives (``conveyor.model.parallel``) join the shards. Only rank 0 samples: the others
compute the logits (their all-gather needs them) and take rank 0's tokens from the next
message, so seeded sampling, penalties and grammars live in one place.

Control goes through pipes, data through ``torch.distributed`` (gloo on CPU, NCCL on CUDA).
A pipe blocks without a timeout, so an idle engine keeps its workers waiting for hours; a
collective has a timeout (``COLLECTIVE_TIMEOUT_S``), and fails at once when a peer's
connection drops. Any failure of a tensor-parallel step is fatal (``TensorParallelError``):
the ranks could not agree on where they are in the step, so the engine stops, loudly.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from conveyor.config import EngineArgs, ModelConfig
from conveyor.core.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.model.llama import CausalLM, load_model
from conveyor.model.loader import load_checkpoint
from conveyor.model.parallel import ShardPlan, TensorParallel, connect
from conveyor.runner.model_runner import KVCacheLayout, ModelRunner

logger = logging.getLogger(__name__)

# A collective that waits longer than this failed (a rank that hangs without dying); a
# step's collectives take milliseconds, the first one waits for every rank's model load.
COLLECTIVE_TIMEOUT_S = 300.0
# Seconds to wait for the workers to load their shards (the first start may build the C++
# kernels: minutes on 2 cores); a worker that dies meanwhile is reported at once.
START_TIMEOUT_S = 900.0
POLL_S = 0.2  # how often a waiting rank 0 looks at its workers' liveness
JOIN_TIMEOUT_S = 10.0  # how long shutdown waits for a worker before killing it


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot continue."""


@dataclass(frozen=True)
class WorkerState:
    """What a rank other than 0 holds between steps (``TensorParallelExecutor.probe``)."""

    rank: int
    request_ids: tuple[str, ...]  # requests whose tokens it keeps (sorted)
    num_kv_blocks: int  # blocks of its KV cache
    kv_cache_bytes: int  # bytes of its KV cache (its heads only)


@dataclass(frozen=True)
class _WorkerSpec:
    """What a spawned rank needs to build its shard (pickled to the child)."""

    args: EngineArgs
    size: int
    port: int
    device: str
    dtype: torch.dtype
    layout: KVCacheLayout
    num_threads: int


def load_shard(checkpoint: Any, args: EngineArgs, tp: TensorParallel, device: torch.device,
               dtype: torch.dtype) -> CausalLM:
    """This rank's model: its slices of the checkpoint's weights, read from the files."""
    return load_model(checkpoint, args, device, dtype, tp)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or the r-th GPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallelExecutor:
    """Rank 0's side: spawns the other ranks, joins their group, and runs each step on
    every rank (``execute``, in place of ``ModelRunner.execute``)."""

    def __init__(self, tp: TensorParallel, store: Any, processes: list[Any],
                 conns: list[Connection]) -> None:
        self.tp = tp
        self._store = store  # kept alive: the group's rendezvous lives in rank 0's store
        self.processes = processes  # rank i + 1
        self.conns = conns
        self.runner: ModelRunner | None = None
        self._sampled: dict[str, list[int]] = {}  # rank 0's last samples, sent with the next step
        self._closed = False

    @classmethod
    def start(cls, args: EngineArgs, config: ModelConfig, device: torch.device,
              dtype: torch.dtype, layout: KVCacheLayout) -> TensorParallelExecutor:
        """Spawn ranks 1..N-1 (they load their shards while rank 0 loads its own) and form
        the group with them."""
        from torch import distributed as dist

        size = args.tensor_parallel_size
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this host
        store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
        threads = max(1, (os.cpu_count() or 1) // size)
        if device.type == "cpu":
            torch.set_num_threads(threads)  # one share of the cores per rank
        spec = _WorkerSpec(args, size, store.port, str(device), dtype, layout, threads)
        ctx = mp.get_context("spawn")
        processes, conns = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_worker_main, args=(rank, spec, theirs), daemon=True,
                                  name=f"conveyor-tp-rank{rank}")
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        executor = cls(TensorParallel(None), store, processes, conns)
        try:
            # Every worker up (imports done, a crash reported) before the rendezvous, which
            # waits for all ranks without looking at their liveness.
            executor._wait_for_all("started", "starting")
            backend = connect(store, 0, size, device, COLLECTIVE_TIMEOUT_S)
        except Exception as error:
            failure = error if isinstance(error, TensorParallelError) else \
                executor.failure(error)
            executor.shutdown()
            raise failure from error
        executor.tp = TensorParallel(ShardPlan(config, 0, size), backend)
        logger.info("tensor parallelism: %d ranks (rank 0 here, %d spawned: pids %s), %s, "
                    "%d thread(s) each", size, size - 1, [p.pid for p in processes],
                    "nccl" if device.type == "cuda" else "gloo", threads)
        return executor

    def attach(self, runner: ModelRunner) -> TensorParallelExecutor:
        """Rank 0's runner; waits until every other rank has loaded its shard."""
        self.runner = runner
        self._wait_for_all("ready", "loading its shard")
        return self

    def _wait_for_all(self, expected: str, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns, 1):
            reply = self._receive(conn, deadline, f"rank {rank} {what}")
            if reply != expected:
                raise self.failure(RuntimeError(f"rank {rank} sent {reply!r}"))

    # ------------------------------------------------------------------ the step
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to every rank, run rank 0's part, keep its samples for the next."""
        assert self.runner is not None, "attach() first"
        self._check_alive()
        message = pickle.dumps((out, self._sampled), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
            result = self.runner.execute(out)
        except Exception as error:
            raise self.failure(error) from error
        self._sampled = result.sampled_token_ids
        return result

    def probe(self) -> list[WorkerState]:
        """Every other rank's state (between steps): what it holds."""
        self._check_alive()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        for conn in self.conns:
            conn.send_bytes(pickle.dumps("probe"))
        return [self._receive(conn, deadline, f"rank {rank}'s state")
                for rank, conn in enumerate(self.conns, 1)]

    def __getattr__(self, name: str) -> Any:
        """Everything else is rank 0's runner's (its model, KV caches, sampler)."""
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ------------------------------------------------------------------ failures
    def _check_alive(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        if any(p.exitcode is not None for p in self.processes):
            raise self.failure(None)

    def _receive(self, conn: Connection, deadline: float, what: str) -> Any:
        """The next message of a worker; TensorParallelError when it dies or is late."""
        while not conn.poll(POLL_S):
            if any(p.exitcode is not None for p in self.processes):
                raise self.failure(None)
            if time.monotonic() > deadline:
                raise self.failure(TimeoutError(f"timed out waiting for {what}"))
        try:
            reply = pickle.loads(conn.recv_bytes())
        except EOFError:
            raise self.failure(None) from None
        if isinstance(reply, tuple) and reply[:1] == ("error",):
            raise TensorParallelError(f"tensor-parallel {what} failed:\n{reply[1]}")
        return reply

    def failure(self, error: BaseException | None) -> TensorParallelError:
        """The error to raise: which ranks died (exit codes) or failed (their tracebacks),
        else rank 0's own ``error``."""
        end = time.monotonic() + 2.0  # a peer's dropped connection may precede its exit
        while time.monotonic() < end and all(p.exitcode is None for p in self.processes):
            time.sleep(0.05)
        problems = []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True), 1):
            detail = _last_error(conn)
            if process.exitcode is not None or detail:
                problems.append(f"rank {rank} (pid {process.pid}) "
                                f"{_exit_text(process.exitcode)}{detail}")
        if problems:
            return TensorParallelError("tensor-parallel worker failed, the engine cannot "
                                       "continue: " + "; ".join(problems))
        return TensorParallelError(f"tensor-parallel step failed on rank 0, the engine cannot "
                                   f"continue: {type(error).__name__}: {error}")

    def shutdown(self) -> None:
        """Stop every worker (a clean exit; killed if it does not come within
        JOIN_TIMEOUT_S). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # already gone
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
                process.join(JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "is alive"
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _last_error(conn: Connection) -> str:
    """The traceback a failed worker sent before exiting, if any."""
    try:
        while conn.poll(0):
            reply = pickle.loads(conn.recv_bytes())
            if isinstance(reply, tuple) and reply[:1] == ("error",):
                return ":\n" + str(reply[1])
    except (EOFError, OSError):
        pass
    return ""


# ---------------------------------------------------------------------- the worker side
def _worker_main(rank: int, spec: _WorkerSpec, conn: Connection) -> None:
    """Rank ``rank``'s process: join the group, load the shard, run steps until told to stop
    (or until rank 0's end of the pipe closes)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s "
                        "%(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 decides (a server drains first), and
    # a worker follows it through its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send_bytes(pickle.dumps("started"))
        runner = _build_worker(rank, spec)
        conn.send_bytes(pickle.dumps("ready"))
        _serve(rank, runner, conn)
    except EOFError:
        return  # rank 0 is gone: nothing left to serve
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except OSError:
            pass
        raise SystemExit(1) from None


def _build_worker(rank: int, spec: _WorkerSpec) -> ModelRunner:
    from torch import distributed as dist

    args = spec.args
    device = rank_device(torch.device(spec.device), rank)
    if device.type == "cpu":
        torch.set_num_threads(spec.num_threads)
    else:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.size, False)
    backend = connect(store, rank, spec.size, device, COLLECTIVE_TIMEOUT_S)
    checkpoint = load_checkpoint(args.model, args.load_format, args.tokenizer)
    tp = TensorParallel(ShardPlan(checkpoint.config, rank, spec.size), backend)
    model = load_shard(checkpoint, args, tp, device, spec.dtype)
    return ModelRunner(model, spec.layout, device, args.seed, grammars=None, sampling=False)


def _serve(rank: int, runner: ModelRunner, conn: Connection) -> None:
    while True:
        message = pickle.loads(conn.recv_bytes())  # EOFError when rank 0 is gone
        if message is None:
            return
        if message == "probe":
            kv = runner.kv_caches
            conn.send_bytes(pickle.dumps(WorkerState(
                rank, tuple(sorted(runner.tokens)), runner.kv_caches.shape[2],
                kv.numel() * kv.element_size())))
            continue
        out, sampled = message
        runner.add_sampled(sampled)
        runner.execute(out)
