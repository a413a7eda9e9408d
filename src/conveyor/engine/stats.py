"""The engine's statistics and step trace as typed records, read by attribute.

``LLMEngine.stats()`` returns an ``EngineStats`` snapshot and ``LLMEngine.step_trace`` holds
one ``StepTrace`` per step. The server's metrics, ``/stats``, the benchmarks and the tests
read fields by name, so a renamed field fails type checking, not a soak at runtime. Field
names are the keys of the JSON that ``/stats`` and the benchmark reports print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

# finish_reason values counted in EngineStats.finished_by_reason.
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters and gauges after a step (cumulative since start)."""

    kv_blocks_total: int  # device KV blocks
    kv_blocks_free: int  # free device blocks (unreferenced prefix-cached blocks count as free)
    kv_cache_usage: float  # share of device blocks in use, 0..1
    num_preemptions: int  # requests preempted (recompute or swap)
    num_preempted_tokens: int  # computed tokens thrown away by recompute preemption
    num_requests_running: int  # sequences running now
    num_requests_waiting: int  # sequences waiting now (new, preempted, samples 2..n of n > 1)
    num_steps: int  # steps scheduled
    num_swapped_blocks: int  # blocks copied to host memory by swap preemption
    peak_num_requests_running: int  # most sequences running in one step
    peak_kv_utilization: float  # at that peak: share of allocated KV slots holding tokens
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    num_prompt_tokens: int  # prompt tokens of the requests added
    num_generation_tokens: int  # tokens generated
    # Finished sequences per finish_reason (FINISH_REASONS); a copy, never the engine's own.
    finished_by_reason: dict[str, int]
    kv_cache_tokens: int = 0  # KV capacity: blocks x block size (grows with TP at one budget)
    tensor_parallel_size: int = 1  # ranks the model is split across
    # Structured outputs (conveyor.structured.compiler.GrammarStats)
    grammar_compiles: int = 0  # grammars compiled (cache misses), failed ones too
    grammar_cache_hits: int = 0  # constrained requests whose grammar was cached
    grammar_compile_seconds: float = 0.0  # total compile time
    grammar_compile_errors: int = 0  # constraints the grammar engine refused (400s)
    grammar_compile_timeouts: int = 0  # compiles that outlived grammar_compile_timeout (400s)
    # tokens a grammar forced, verified as drafts (grammar_forced_drafts), and of those kept
    grammar_forced_draft_tokens: int = 0
    grammar_forced_accepted_tokens: int = 0
    # Speculative decoding (vLLM's spec_decode_* names; zeros when it is off):
    spec_decode_num_drafts: int = 0  # verifies (a request's step with drafted tokens)
    spec_decode_num_draft_tokens: int = 0  # tokens drafted
    spec_decode_num_accepted_tokens: int = 0  # drafted tokens accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # by draft position
    spec_decode_num_steps_off: int = 0  # steps where the cost model let nobody draft

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Share of drafted tokens accepted (0 without drafts)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verify yields on average: accepted drafts + the one sampled (0: none)."""
        drafts = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the field names as keys."""
        return {**dataclasses.asdict(self),
                "spec_decode_acceptance_rate": self.spec_decode_acceptance_rate,
                "spec_decode_mean_accepted_length": self.spec_decode_mean_accepted_length}


def spec_decode_fields(stats: Any) -> dict[str, Any]:
    """EngineStats' spec_decode_* fields from the scheduler's SpecDecodeStats (or None)."""
    if stats is None:
        return {}
    return {"spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(stats.accepted_per_pos),
            "spec_decode_num_steps_off": stats.num_steps_off}


class ScheduledEntry(NamedTuple):
    """One request's share of a traced step."""

    request_id: str
    num_new_tokens: int  # tokens computed for it in the step
    # "decode" (one new token after computed ones: a generated token's step, or a prompt's
    # last token left alone by chunking or a prefix hit), "verify" (a decode with drafted
    # tokens) or "prefill" (any other prompt or recompute chunk): llm_engine._step_kind
    kind: str


@dataclass(frozen=True)
class StepTrace:
    """One step's scheduling decisions (recorded with the engine argument ``step_trace``)."""

    step: int  # the scheduler's step id
    time: float  # time.perf_counter() when the step began
    duration: float  # seconds the step took (schedule, forward, update, outputs)
    scheduled: tuple[ScheduledEntry, ...]  # who ran how many tokens, in batch order
    preempted: tuple[str, ...]  # request ids preempted in this step (sorted)
    waiting: tuple[str, ...]  # request ids waiting after the step, in the policy's order
    finished: tuple[str, ...]  # request ids that finished in the step
    kv_blocks_used: int  # device KV blocks in use after the step
    kv_blocks_total: int  # device KV blocks
