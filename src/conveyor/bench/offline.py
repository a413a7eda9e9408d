"""`conveyor bench offline`: a seeded workload through `LLM.generate`, and the roofline check.

Reference workload (issue 2): 64 requests, prompts of 50-300 tokens, ``max_tokens`` 16-64 for
80% of them and 256 for 20%, ``ignore_eos``, all arriving at once. Besides throughput it
measures, in the same run, a decode step at batch B against the model's bare matmuls at that
batch (the roofline a decode step can approach): their ratio is the engine's overhead.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from conveyor.engine.llm import LLM
from conveyor.model.device import machine_name
from conveyor.model.layers import matmul_kernels
from conveyor.ops import ReferenceBackend
from conveyor.runner.cuda_graphs import no_collection_inside
from conveyor.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# Token ids for synthetic prompts are drawn above the special tokens of common vocabularies.
_FIRST_PLAIN_TOKEN = 1000


@dataclass(frozen=True)
class Workload:
    num_requests: int = 64
    prompt_len: tuple[int, int] = (50, 300)
    short_output: tuple[int, int] = (16, 64)
    long_output: int = 256
    long_fraction: float = 0.2
    seed: int = 0

    def requests(self, vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
        rng = random.Random(self.seed)
        num_long = round(self.long_fraction * self.num_requests)
        is_long = [True] * num_long + [False] * (self.num_requests - num_long)
        rng.shuffle(is_long)
        out = []
        for long in is_long:
            n = rng.randint(*self.prompt_len)
            prompt = [rng.randrange(_FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n)]
            max_tokens = self.long_output if long else rng.randint(*self.short_output)
            out.append((prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True)))
        return out

    def prompts(self, llm: LLM) -> list[tuple[list[int], SamplingParams]]:
        return self.requests(llm.engine.model_config.vocab_size)


# nano-vllm's benchmark (its bench.py, the workload of vLLM's published comparison): 256
# requests, prompt and output lengths each uniform in 100-1024 tokens, ignore_eos.
NANO_VLLM_WORKLOAD = Workload(num_requests=256, prompt_len=(100, 1024),
                              short_output=(100, 1024), long_fraction=0.0)
# `conveyor bench offline --workload NAME` (besides "grounded", conveyor.bench.grounded)
WORKLOADS = {"reference": Workload(), "nano-vllm": NANO_VLLM_WORKLOAD}


@dataclass
class OfflineResult:
    num_requests: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    num_steps: int
    num_preemptions: int
    # speculative decoding in this run (0 when off): share of drafted tokens accepted, and
    # tokens a verify yielded on average (accepted drafts + the sampled one)
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    requests_per_s: float = field(init=False)
    output_tokens_per_s: float = field(init=False)
    total_tokens_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.requests_per_s = self.num_requests / self.duration_s
        self.output_tokens_per_s = self.output_tokens / self.duration_s
        self.total_tokens_per_s = (self.prompt_tokens + self.output_tokens) / self.duration_s


def run_workload(llm: LLM, workload: Any) -> OfflineResult:
    """Run the workload (a Workload or GroundedWorkload) once, all requests at once, and
    time it."""
    requests = workload.prompts(llm)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [s for _, s in requests]
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    after = llm.stats()
    return OfflineResult(
        num_requests=len(outputs), duration_s=duration,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        num_steps=after.num_steps - before.num_steps,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        **_spec_delta(before, after))


def _spec_delta(before: Any, after: Any) -> dict[str, float]:
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    if not drafts:
        return {}
    return {"spec_acceptance_rate": accepted / drafted,
            "spec_mean_accepted_length": 1 + accepted / drafts}


@torch.inference_mode()
def bare_matmul_time(llm: LLM, batch: int, repeats: int = 5, dense: bool = False) -> float:
    """Seconds for all of the model's matmuls (projections, MLP, LM head) at ``batch``
    tokens: no attention, no norms, no sampling, no Python scheduling. With the engine's own
    kernels, or ``dense``: on the bf16 weights, without the GGUF-block kernels (the issue's
    roofline: the machine's bf16 matrix units). On CUDA the matmuls replay as one CUDA graph:
    launched one by one from Python, a small model's hundreds of matmuls time the launches,
    not the GPU (the engine's decode steps replay graphs too)."""
    engine = llm.engine
    layers = engine.runner.model.matmul_layers(dense=dense)
    inputs = {n: torch.randn(batch, n, dtype=engine.dtype, device=engine.device)
              for _, n in layers}

    def matmuls() -> None:
        for matmul, n in layers:
            matmul(inputs[n])

    run = _cuda_graph_of(matmuls, engine.device) if engine.device.type == "cuda" else matmuls
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _cuda_graph_of(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``fn``'s kernels captured once (after a warm-up run), as a call that replays them and
    waits for them; where capture fails, ``fn`` launched eagerly (and a warning says so)."""
    fn()  # warm-up outside the graph: cuBLAS picks its kernels and workspaces
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with no_collection_inside(), torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        logger.warning("bare matmuls not captured (%s): timed as eager launches", e)

        def eager() -> None:
            fn()
            torch.cuda.synchronize(device)

        return eager

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize(device)

    return replay


# Tokens each request of a timed decode step has in its context.
DECODE_CONTEXT_LEN = 128


def decode_step_time(llm: LLM, batch: int, context_len: int = DECODE_CONTEXT_LEN,
                     steps: int = 8) -> float:
    """Median seconds of an engine step in which ``batch`` requests each decode one token."""
    engine = llm.engine
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    # Room for every request to keep decoding however many steps the prefill takes (the
    # first-prefilled ones decode meanwhile): the timed steps must run `batch` decodes.
    max_tokens = engine.scheduler_config.max_model_len - context_len
    if max_tokens < steps + 2:
        raise ValueError(f"max_model_len must exceed context_len + {steps + 2}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # as the server
    ids = [engine.add_request({"prompt_token_ids": [rng.randrange(_FIRST_PLAIN_TOKEN, vocab)
                                                    for _ in range(context_len)]}, params)
           for _ in range(batch)]
    try:
        # Prefill everyone (and take the first decode) before timing.
        while engine.scheduler.num_waiting or any(
                r.num_output_tokens < 2 for r in engine.scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            if len(engine.scheduler.running) != batch:
                raise RuntimeError(f"a timed step would decode {len(engine.scheduler.running)} "
                                   f"requests, not {batch}")
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        engine.abort_request(ids)
    return sorted(times)[len(times) // 2]


# Added to the workload's seed for the warm-up run: other prompts, so no prefix-cache hits.
WARMUP_SEED_OFFSET = 1000


def warm_up_on(llm: LLM, workload: Any) -> None:
    """The workload once with another seed, untimed. The first run in a process pays one-time
    costs (among them oneDNN building a kernel for each new batch size): measured, it ran
    4-10 % slower than the same run right after, and a second engine in the same process
    would inherit the first one's warm state."""
    run_workload(llm, replace(workload, seed=workload.seed + WARMUP_SEED_OFFSET))
    llm.engine.check_integrity()


def decode_step_bytes(llm: LLM, batch: int, context_len: int = DECODE_CONTEXT_LEN) -> int:
    """Bytes a decode step of ``batch`` requests at ``context_len`` tokens reads: the weights
    of its matmuls (GGUF blocks where the engine reads them) and every request's K/V."""
    engine = llm.engine
    kv = batch * (context_len + 1) * engine.kv_layout.bytes_per_token
    return engine.runner.model.decode_weight_bytes() + kv


def roofline_rows(llm: LLM, batches: tuple[int, ...]) -> list[dict[str, float]]:
    """A decode step against the bare matmuls at each batch size: the bf16 matmuls (the
    roofline; ``ratio``) and the engine's own, which read GGUF blocks where it can
    (``ratio_engine_matmuls``: the step's overhead over what its matmuls cost); and the bytes
    the step reads with the bandwidth that implies (the distance to the memory roofline)."""
    rows = []
    for batch in batches:
        dense = bare_matmul_time(llm, batch, dense=True)
        own = bare_matmul_time(llm, batch)
        step = decode_step_time(llm, batch)
        read = decode_step_bytes(llm, batch)
        rows.append({"batch": batch, "bare_matmul_ms": dense * 1e3,
                     "engine_matmul_ms": own * 1e3, "decode_step_ms": step * 1e3,
                     "ratio": step / dense, "ratio_engine_matmuls": step / own,
                     "step_mb_read": read / 1e6, "step_gb_per_s": read / step / 1e9})
    return rows


@dataclass(frozen=True)
class SingleStream:
    """One request alone: its prompt, then greedy tokens (``ignore_eos``)."""

    prompt_len: int = 100
    max_tokens: int = 128


def single_stream(llm: LLM, stream: SingleStream) -> dict[str, float]:
    """Time to first token and the decode rate of one request alone (tokens after the first
    over the time after the first): what one user of an idle server sees."""
    engine = llm.engine
    rng = random.Random(2)
    prompt = [rng.randrange(_FIRST_PLAIN_TOKEN, engine.model_config.vocab_size)
              for _ in range(stream.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=stream.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # as the server
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params)
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None and any(r.num_output_tokens for r in engine.scheduler.running):
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {"prompt_len": stream.prompt_len, "output_tokens": stream.max_tokens,
            "ttft_ms": (first - start) * 1e3,
            "decode_tokens_per_s": (stream.max_tokens - 1) / (end - first)}


def combined(results: list[OfflineResult]) -> OfflineResult:
    """Runs of one workload as one result: their requests, tokens, steps and time summed (so
    its rates are totals over total time), the speculation figures averaged."""
    return OfflineResult(
        num_requests=sum(r.num_requests for r in results),
        duration_s=sum(r.duration_s for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        output_tokens=sum(r.output_tokens for r in results),
        num_steps=sum(r.num_steps for r in results),
        num_preemptions=sum(r.num_preemptions for r in results),
        spec_acceptance_rate=statistics.fmean(r.spec_acceptance_rate for r in results),
        spec_mean_accepted_length=statistics.fmean(r.spec_mean_accepted_length
                                                   for r in results))


def run_rounds(llms: list[LLM], workload: Any, rounds: int) -> list[list[OfflineResult]]:
    """The workload ``rounds`` times on each engine, the engines in turn (A, B, A, B, ...):
    a machine whose speed drifts by tens of percent within minutes (measured on a 2-core VM)
    then slows both sides of a ratio alike, where one engine's runs after the other's would
    not. Round r takes the workload's seed + r: other prompts each round (a prompt run twice
    would be a prefix-cache hit), the same ones on every engine."""
    runs: list[list[OfflineResult]] = [[] for _ in llms]
    for r in range(rounds):
        this_round = replace(workload, seed=workload.seed + r)
        for llm, got in zip(llms, runs, strict=True):
            got.append(run_workload(llm, this_round))
    return runs


def _summary(runs: list[OfflineResult]) -> dict[str, Any]:
    return {**asdict(combined(runs)),
            "rounds": [{"output_tokens": r.output_tokens, "duration_s": r.duration_s,
                        "output_tokens_per_s": r.output_tokens_per_s} for r in runs]}


def _reference_ops(reference_llm: LLM, workload: Any, warmup: bool,
                   result: dict[str, Any]) -> dict[str, Any]:
    reference_llm.engine.runner.use_backend(ReferenceBackend())
    if warmup:
        warm_up_on(reference_llm, workload)
    reference = asdict(run_workload(reference_llm, workload))
    reference["kernels_over_reference"] = (result["output_tokens_per_s"]
                                           / reference["output_tokens_per_s"])
    reference_llm.engine.check_integrity()
    return reference


def run_offline(llm: LLM, workload: Any, roofline_batches: tuple[int, ...] = (1, 16, 64),
                warmup: bool = True, reference_llm: LLM | None = None,
                against: tuple[LLM, list[str]] | None = None,
                rounds: int = 1) -> dict[str, Any]:
    """Throughput of the workload plus decode-step-vs-matmul ratios, in one run; with
    ``reference_llm`` (the same engine arguments) also the workload through the torch
    reference ops instead of the C++ kernels, and the ratio; with ``against`` (a second
    engine and the engine arguments it changes) its throughput, ratio and decode steps. The
    workload runs ``rounds`` times on this engine and the ``against`` one, in turn
    (``run_rounds``), and their throughputs are totals over the rounds (the reference-ops
    engine runs it once)."""
    if not 1 <= rounds < WARMUP_SEED_OFFSET:  # the warm-up's seed must stay another one
        raise ValueError(f"rounds must be in [1, {WARMUP_SEED_OFFSET}), got {rounds}")
    engines = [llm] if against is None else [llm, against[0]]
    if warmup:
        for engine in engines:
            warm_up_on(engine, workload)
    runs = run_rounds(engines, workload, rounds)
    result = _summary(runs[0])
    reference = (None if reference_llm is None
                 else _reference_ops(reference_llm, workload, warmup, result))
    other: dict[str, Any] | None = None
    if against is not None:
        other_result = _summary(runs[1])
        other = {"changes": against[1], "result": other_result,
                 "throughput_ratio": (result["output_tokens_per_s"]
                                      / other_result["output_tokens_per_s"])}
    # No roofline batches: no decode-step timings and no single stream either (quick runs).
    roofline = roofline_rows(llm, roofline_batches)
    stream = single_stream(llm, SingleStream()) if roofline_batches else None
    if against is not None and other is not None:
        other["roofline"] = roofline_rows(against[0], roofline_batches)
        other["single_stream"] = (single_stream(against[0], SingleStream())
                                  if roofline_batches else None)
        against[0].engine.check_integrity()
    llm.engine.check_integrity()
    return {"workload": asdict(workload), "rounds": rounds, "result": result,
            "roofline": roofline, "single_stream": stream, "reference_ops": reference,
            "against": other, "engine": _engine_summary(llm)}


def _engine_summary(llm: LLM) -> dict[str, Any]:
    engine = llm.engine
    return {"dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "machine": machine_name(engine.device),
            "matmuls": (matmul_kernels(engine.dtype, engine.args.amx_matmuls)
                        if engine.device.type == "cpu" else "torch"),
            "kv_cache_dtype": llm.engine.kv_layout.kv_cache_dtype,
            "max_num_seqs": llm.engine.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens,
            "threads": torch.get_num_threads()}


ROOFLINE_HEADER = (f"{'batch':>5} {'bf16 matmuls':>12} {'own matmuls':>11} {'decode step':>11} "
                   f"{'ratio':>5}  {'own':>4} {'MB read':>7} {'GB/s':>5}")


def _roofline_line(row: dict[str, float]) -> str:
    return (f"{row['batch']:>5} {row['bare_matmul_ms']:>12.1f} {row['engine_matmul_ms']:>11.1f} "
            f"{row['decode_step_ms']:>11.1f} {row['ratio']:>5.2f}  "
            f"{row['ratio_engine_matmuls']:>4.2f} {row['step_mb_read']:>7.1f} "
            f"{row['step_gb_per_s']:>5.1f}")


def _stream_line(stream: dict[str, float]) -> str:
    label = f"One stream ({stream['prompt_len']} + {stream['output_tokens']} tokens), tok/s:"
    return f"{label:<40}{stream['decode_tokens_per_s']:.1f} (TTFT {stream['ttft_ms']:.0f} ms)"


def _spec_lines(result: dict[str, Any]) -> list[str]:
    if not result.get("spec_mean_accepted_length"):
        return []
    return [f"{'Spec decode mean accepted length:':<40}{result['spec_mean_accepted_length']:.2f}",
            f"{'Spec decode acceptance rate:':<40}{result['spec_acceptance_rate']:.2f}"]


def _rounds_lines(report: dict[str, Any], result: dict[str, Any]) -> list[str]:
    if report.get("rounds", 1) == 1:
        return []
    each = " ".join(f"{r['output_tokens_per_s']:.1f}" for r in result["rounds"])
    return [f"{'Rounds (output tok/s each):':<40}{each}"]


def _machine_lines(report: dict[str, Any]) -> list[str]:
    engine = report.get("engine", {})  # (reports saved before these keys have none)
    return [f"{label:<40}{engine[key]}" for label, key in (("Machine:", "machine"),
                                                          ("Matmuls:", "matmuls"))
            if key in engine]


def format_offline(report: dict[str, Any]) -> str:
    r = report["result"]
    lines = [
        "============ Offline Benchmark Result ============",
        *_machine_lines(report),
        f"{'Requests:':<40}{r['num_requests']}",
        f"{'Duration (s):':<40}{r['duration_s']:.2f}",
        f"{'Prompt tokens:':<40}{r['prompt_tokens']}",
        f"{'Output tokens:':<40}{r['output_tokens']}",
        f"{'Engine steps:':<40}{r['num_steps']}",
        f"{'Preemptions:':<40}{r['num_preemptions']}",
        f"{'Request throughput (req/s):':<40}{r['requests_per_s']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{r['output_tokens_per_s']:.1f}",
        f"{'Total token throughput (tok/s):':<40}{r['total_tokens_per_s']:.1f}",
        *_rounds_lines(report, r),
        *_spec_lines(r),
        "--------- Decode step vs matmuls (ms) -----------",
        ROOFLINE_HEADER,
    ]
    lines += [_roofline_line(row) for row in report["roofline"]]
    if report["single_stream"]:
        lines.append(_stream_line(report["single_stream"]))
    ref = report.get("reference_ops")
    if ref:
        lines += ["------------ C++ kernels vs torch ops -------------",
                  f"{'Output tok/s, torch reference ops:':<40}{ref['output_tokens_per_s']:.1f}",
                  f"{'Kernels / reference:':<40}{ref['kernels_over_reference']:.2f}"]
    other = report.get("against")
    if other:
        changes = " ".join(other["changes"])
        lines += [f"{' against ' + changes + ' ':-^50}",
                  f"{'Output tok/s:':<40}{other['result']['output_tokens_per_s']:.1f}",
                  *_rounds_lines(report, other["result"]),
                  *_spec_lines(other["result"]),
                  f"{'This engine / that one:':<40}{other['throughput_ratio']:.2f}",
                  ROOFLINE_HEADER]
        lines += [_roofline_line(row) for row in other["roofline"]]
        if other["single_stream"]:
            lines.append(_stream_line(other["single_stream"]))
    lines += ["ratio: decode step / bf16 matmuls (the roofline); own: / the engine's own",
              "matmuls (GGUF blocks read in place where it can); MB read: weights and K/V",
              f"a decode step reads at {DECODE_CONTEXT_LEN} tokens of context; GB/s: that over "
              "the step's time", "=" * 50]
    return "\n".join(lines)
