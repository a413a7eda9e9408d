"""The step loop: schedule, run, update, detokenize, stop checks.

``LLMEngine`` is synchronous and single-threaded; ``LLM`` (offline) and ``AsyncEngine``
(the server) drive it. With ``async_scheduling`` a step is launched one ahead of the results
the engine takes (``engine/pipeline.py``). Bad input raises ``ValueError`` from
``add_request`` and never reaches the scheduler, so one bad request cannot disturb the
others; a forward pass that raises ends only the requests it ran (finish_reason "error").
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from conveyor.config import EngineArgs, ModelConfig
from conveyor.core.kv_cache_manager import BlockMap, KVCacheManager
from conveyor.core.outputs import Logprob, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from conveyor.core.scheduler import Scheduler
from conveyor.engine.pipeline import StepPipeline, Submitted
from conveyor.engine.sequence import RequestGroup, Sequence
from conveyor.engine.stats import (
    FINISH_REASONS,
    EngineStats,
    ScheduledEntry,
    StepTrace,
    spec_decode_fields,
)
from conveyor.model.device import resolve_device, resolve_dtype
from conveyor.model.llama import CausalLM, load_model
from conveyor.model.loader import Checkpoint, load_checkpoint
from conveyor.model.parallel import ShardPlan, check_tensor_parallel
from conveyor.ops import select_backend
from conveyor.ops.openmp import release_openmp_threads
from conveyor.outputs import RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.runner.cuda_graphs import CudaGraphSpec
from conveyor.runner.draft import DraftModelProposer, load_draft_model
from conveyor.runner.model_runner import KVCacheLayout, ModelRunner
from conveyor.runner.tensor_parallel import TensorParallelError, TensorParallelExecutor
from conveyor.sampling_params import RequestOutputKind, SamplingParams
from conveyor.structured.compiler import GrammarCompiler, GrammarError, GrammarStats
from conveyor.tokenizer.chat_template import compile_template
from conveyor.tokenizer.detokenizer import IncrementalDetokenizer
from conveyor.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]

# Failed steps in a row after which the engine gives up (step() raises): a device or a bug
# that fails every step would otherwise turn every request into an error while the engine
# still accepts them.
MAX_CONSECUTIVE_STEP_FAILURES = 3


def _default_sampling(checkpoint: Checkpoint, generation_config: str) -> dict[str, Any]:
    """The sampling defaults a request takes where it sets nothing (vLLM's
    ``--generation-config auto``): generation_config.json's, if they make valid parameters."""
    defaults = checkpoint.sampling_defaults if generation_config == "auto" else {}
    if not defaults:
        return {}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        logger.warning("generation_config.json's sampling defaults %s are not used: %s",
                       defaults, e)
        return {}
    logger.info("sampling defaults from the model's generation_config.json: %s (a request's "
                "own values win; generation_config='vllm' drops them)", defaults)
    return dict(defaults)


def _replace_chat_template(tokenizer: Tokenizer | None, template: str) -> None:
    """``chat_template``: a template, or a file holding one, instead of the model's; checked
    now (a ValueError naming the setting), not at the first chat request."""
    if tokenizer is None:
        raise ValueError("chat_template needs a model with a tokenizer")
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    try:
        compile_template(template)
    except ValueError as e:
        raise ValueError(f"chat_template: {e}") from None
    tokenizer.chat_template = template


def _token_ids(ids: Any) -> list[int]:
    """Token ids as Python ints: numpy's (an array, np.int64 items, as datasets give them)
    are taken; anything else that is not an integer is a ValueError naming the field."""
    if isinstance(ids, str) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {ids!r:.80}")
    bad = next((t for t in ids if isinstance(t, bool) or not hasattr(t, "__index__")), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids must be integers, got {bad!r:.40}")
    return [operator.index(t) for t in ids]


def served_name(model: str | None, path: str) -> str:
    """The API's model id: the file or folder name without .gguf (the default model too)."""
    name = os.path.basename(os.path.normpath(path))
    return name.removesuffix(".gguf") if model is None or path.endswith(".gguf") else name


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        t0 = time.perf_counter()
        checkpoint = load_checkpoint(args.model, args.load_format, args.tokenizer)
        self.model_config: ModelConfig = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        if args.chat_template is not None:
            _replace_chat_template(self.tokenizer, args.chat_template)
        if self.tokenizer is not None:  # the model's too: generation_config.json lists Llama
            # 3's <|eot_id|> beside the tokenizer's <|end_of_text|> (vLLM stops on both)
            self.tokenizer.add_eos_token_ids(self.model_config.eos_token_ids)
        names = args.served_model_name or served_name(args.model, checkpoint.path)
        # The names requests may give; the first is the one answers carry
        self.model_names: tuple[str, ...] = (names,) if isinstance(names, str) else names
        self.model_name = self.model_names[0]
        self.default_sampling = _default_sampling(checkpoint, args.generation_config)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.parallel_config = args.parallel_config()
        tp_size = self.parallel_config.tensor_parallel_size
        if tp_size > 1:
            check_tensor_parallel(self.model_config, tp_size)
        self.scheduler_config = args.scheduler_config(self.model_config.max_position_embeddings)
        cache_config = args.cache_config()
        sched = self.scheduler_config
        self.speculative_config = args.spec_config()
        if tp_size > 1 and self.speculative_config is not None \
                and self.speculative_config.method == "draft_model":
            raise ValueError("speculative_config.method draft_model does not run with "
                             "tensor_parallel_size > 1 yet")
        draft = load_draft_model(self.speculative_config, args, self.model_config,
                                 self.tokenizer, self.dtype, self.device, sched.max_model_len)
        # Every rank's cache has the same blocks, sized by the rank with the most KV heads.
        self.kv_layout = KVCacheLayout.from_budget(
            ShardPlan(self.model_config, 0, tp_size).cache_config() if tp_size > 1
            else self.model_config, cache_config, self.dtype, swap=sched.preemption == "swap",
            draft=draft.config if draft is not None else None,
            tiles=select_backend(self.device, self.dtype).kv_cache_tiles)
        kv_manager = KVCacheManager(
            self.kv_layout.num_blocks, cache_config.block_size,
            cache_config.enable_prefix_caching, self.kv_layout.num_swap_blocks,
            reserve_tokens=sched.max_model_len if sched.kv_allocation == "reserve" else None)
        self.scheduler = Scheduler(sched, kv_manager, speculative=self.speculative_config)
        self.grammars = (GrammarCompiler(self.tokenizer, args.grammar_compile_timeout,
                                         args.max_grammar_bytes)
                         if self.tokenizer is not None else None)
        self.executor: TensorParallelExecutor | None = None
        self.runner = self._build_runner(checkpoint, draft)
        # (the runner looked up per step: profilers and tests replace it, or its execute)
        self.pipeline = StepPipeline(
            lambda out: self.runner.execute(out),
            (lambda out: self.runner.launch(out)) if sched.async_scheduling else None)
        self.groups: dict[str, RequestGroup] = {}
        self._sequences: dict[str, tuple[RequestGroup, Sequence]] = {}
        self._ids = itertools.count()
        self.finished_by_reason: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_consecutive_step_failures = 0
        # Opt-in per-step record of scheduling decisions (see _trace_step), for plots.
        self.step_trace: list[StepTrace] | None = [] if args.step_trace else None
        # Called with every step's StepTrace when set (the server's live view keeps only a
        # window of them); it must not raise. Set before the first step, by the loop's owner.
        self.trace_listener: Callable[[StepTrace], None] | None = None
        logger.info("loaded %s (%s, %s on %s) in %.1fs", checkpoint.path,
                    self.model_config.architecture, str(self.dtype).removeprefix("torch."),
                    self.device, time.perf_counter() - t0)
        logger.info(self.capacity_summary())
        # The loading thread's OpenMP workers go: a thread that steps the engine makes its
        # own, and with two pools on a small CPU every kernel call waits (ops/openmp.py).
        release_openmp_threads()
        if sched.async_scheduling and self.device.type == "cpu":
            logger.info("async_scheduling on a CPU hides nothing: the forward pass runs on the "
                        "host (docs/benchmarks.md)")

    def _build_runner(self, checkpoint: Checkpoint, draft: CausalLM | None
                      ) -> ModelRunner | TensorParallelExecutor:
        """The model runner; with tensor parallelism, rank 0's inside the executor that
        runs every rank (the other ranks load their shards while this one loads its own)."""
        args = self.args
        if self.parallel_config.tensor_parallel_size == 1:
            model = load_model(checkpoint, args, self.device, self.dtype)
            drafter = (DraftModelProposer(draft, self.kv_layout, self.device)
                       if draft is not None else None)
            # No graphs with a draft model: its proposals run their own forward passes.
            graphs = None if drafter is not None else CudaGraphSpec.for_engine(
                self.device, args.enforce_eager, self.scheduler_config.max_num_seqs,
                self.scheduler_config.max_model_len, self.kv_layout.block_size)
            return ModelRunner(model, self.kv_layout, self.device, args.seed, self.grammars,
                               drafter=drafter, cuda_graphs=graphs,  # (async: no drafts)
                               forced_drafts=args.grammar_forced_drafts
                               and not args.async_scheduling)

        self.executor = executor = TensorParallelExecutor.start(
            args, self.model_config, self.device, self.dtype, self.kv_layout)
        weakref.finalize(self, executor.shutdown)
        try:
            model = load_model(checkpoint, args, self.device, self.dtype, executor.tp)
            return executor.attach(ModelRunner(model, self.kv_layout, self.device, args.seed,
                                               self.grammars,
                                               forced_drafts=args.grammar_forced_drafts))
        except BaseException:
            executor.shutdown()
            raise

    # ------------------------------------------------------------------ info
    def capacity_summary(self) -> str:
        layout, max_len = self.kv_layout, self.scheduler_config.max_model_len
        fits = layout.num_tokens / max_len
        swap = (f"; swap space: {layout.num_swap_blocks} blocks, "
                f"{layout.num_swap_bytes / 2**20:.1f} MiB of host memory"
                if layout.num_swap_blocks else "")
        tp = self.parallel_config.tensor_parallel_size
        ranks = (f" on each of {tp} tensor-parallel ranks (its KV heads only; the rank with "
                 "the most heads sets the blocks)" if tp > 1 else "")
        draft = (f" ({layout.draft_bytes_per_token} of them the draft model's)"
                 if layout.draft_bytes_per_token else "")
        return (f"KV cache: {layout.num_blocks} blocks x {layout.block_size} tokens = "
                f"{layout.num_tokens} tokens, {layout.num_bytes / 2**20:.1f} MiB, "
                f"{layout.bytes_per_token} bytes/token{draft}{ranks}; {fits:.1f} sequences of "
                f"max_model_len={max_len} fit{swap} (all of it written at start)")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also at exit: they are
        daemon processes)."""
        if self.executor is not None:
            self.executor.shutdown()

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.scheduler.kv_cache
        prefix = kv.pool.stats
        grammar = self.grammars.stats if self.grammars is not None else GrammarStats()
        return EngineStats(
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=sched.stats.num_preemptions,
            num_preempted_tokens=sched.stats.num_preempted_tokens,
            num_requests_running=sched.num_running,
            # (samples 2..n waiting for sample 1's prefill too: the server's back-pressure
            # counts them, as vLLM's scheduler holds all n)
            num_requests_waiting=sched.num_waiting + sum(len(g.pending)
                                                         for g in self.groups.values()),
            num_steps=sched.stats.num_steps,
            num_swapped_blocks=sched.stats.num_swapped_blocks,
            peak_num_requests_running=sched.stats.peak_running,
            peak_kv_utilization=sched.stats.peak_kv_utilization,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            finished_by_reason=dict(self.finished_by_reason),
            kv_cache_tokens=self.kv_layout.num_tokens,
            tensor_parallel_size=self.parallel_config.tensor_parallel_size,
            grammar_compiles=grammar.num_compiles,
            grammar_cache_hits=grammar.num_cache_hits,
            grammar_compile_seconds=grammar.compile_seconds,
            grammar_compile_errors=grammar.num_compile_errors,
            grammar_compile_timeouts=grammar.num_compile_timeouts,
            grammar_forced_draft_tokens=sched.stats.num_forced_draft_tokens,
            grammar_forced_accepted_tokens=sched.stats.num_forced_accepted_tokens,
            **spec_decode_fields(sched.spec.stats if sched.spec is not None else None),
        )

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids or {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = _token_ids(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            self.check_prompt_chars(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt, field="prompt")
        if not isinstance(prompt, list | tuple):
            raise ValueError(f"prompt must be a string or a list of token ids, got "
                             f"{prompt!r:.80}")
        ids = _token_ids(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        self.check_token_ids(ids, "prompt_token_ids")
        return None, ids

    def check_prompt_chars(self, text: str, field: str) -> None:
        """ValueError naming `field` when `text` is too long to fit in max_model_len tokens,
        judged by its length alone: tokenizing megabytes costs seconds of CPU, and a text of
        more than max_model_len x (characters of the longest token) cannot fit anyway."""
        max_len = self.scheduler_config.max_model_len
        token_chars = self.tokenizer.max_token_chars if self.tokenizer is not None else 1
        if len(text) > max_len * token_chars:
            raise ValueError(
                f"{field} has {len(text)} characters, more than this model's maximum context "
                f"length of {max_len} tokens can hold (at most {max_len * token_chars}: "
                f"{token_chars} characters per token, the longest in its vocabulary)")

    def check_token_ids(self, ids: list[int], field: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{field} contains token ids outside the vocabulary "
                             f"[0, {vocab}): {bad[:5]}")

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, user: str | None = None) -> str:
        """Validate and queue a request; raises ValueError for bad input."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        # n > 1 samples run as id#0, id#1, ...: none may take a live request's or sample's id.
        sample_ids = [f"{request_id}#{i}" for i in range(params.n)] if params.n > 1 \
            else [request_id]
        clash = next((i for i in sample_ids if i in self._sequences), None)
        if request_id in self.groups or clash is not None:
            detail = "" if clash in (None, request_id) else f" (its sample {clash!r} is)"
            raise ValueError(f"request_id {request_id!r} is already in use{detail}")
        text, ids = self.tokenize_prompt(prompt)
        self.check_token_ids(list(params.stop_token_ids), "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")
        self.check_token_ids(list(params.allowed_token_ids or ()), "allowed_token_ids")
        if params.bad_words:
            params = params.replace(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        self.compile_grammar(params)
        eos = self.model_config.eos_token_ids if self.tokenizer is None \
            else self.tokenizer.eos_token_ids
        requests = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            # (the prompt is scored once, by sample 1; the others reuse its cached blocks)
            scored = params.prompt_logprobs if i == 0 else None
            child = Request(sample_ids[i], list(ids),
                            params.replace(n=1, seed=seed, prompt_logprobs=scored),
                            eos_token_ids=eos,
                            max_model_len=self.scheduler_config.max_model_len,
                            priority=priority, user=user)
            if arrival_time is not None:
                child.times.arrival = arrival_time
            requests.append(child)
        self.scheduler.check_fits(requests[0])  # raises before anything is queued
        sequences = [Sequence(i, r, self._detokenizer(ids, params)) for i, r in enumerate(requests)]
        caching = self.scheduler.kv_cache.enable_caching
        group = RequestGroup(request_id, text, ids, params, sequences,
                             pending=requests[1:] if caching else [])
        self.groups[request_id] = group
        for seq in sequences:
            self._sequences[seq.request.request_id] = (group, seq)
        for r in requests if not caching else requests[:1]:
            self.scheduler.add_request(r)
        self.num_prompt_tokens += len(ids)
        return request_id

    def bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as it begins a text and, where that is another token
        sequence of the same length, as it follows a space (vLLM's rule)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a model with a tokenizer")
        sequences: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False,
                                               field="bad_words"))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False,
                                                 field="bad_words"))
            if not bare or not spaced:
                raise ValueError(f"bad_words: {word!r:.40} has no tokens")
            sequences.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return tuple(sequences)

    def compile_grammar(self, params: SamplingParams, count: bool = True) -> None:
        """Compile (or find cached) the request's constraint; GrammarError (a ValueError)
        when it is bad.

        The server calls this (``count=False``) in a worker thread before adding the
        request, so that the engine loop only finds it in the cache."""
        spec = params.structured_outputs
        if spec is None:
            return
        if self.grammars is None:
            raise ValueError("structured_outputs needs a model with a tokenizer")
        try:
            self.grammars.compile(spec, count)
        except GrammarError as e:
            raise GrammarError(f"structured_outputs.{e.kind}", e.detail) from None

    def _detokenizer(self, ids: list[int], params: SamplingParams
                     ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None  # (token ids only: the text stays empty)
        return IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); their blocks free at once."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        outputs = self._end_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._drain_if_idle()
        return outputs

    def _end_requests(self, request_ids: Iterable[str],
                      status: RequestStatus) -> list[RequestOutput]:
        """Finish whole user requests (all n samples) with `status`; their final outputs."""
        outputs = []
        for request_id in request_ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            group.pending.clear()
            self.scheduler.finish_requests([s.request.request_id for s in group.sequences],
                                           status)
            for seq in group.sequences:
                if seq.finish_reason is None:
                    seq.finish_reason = status.finish_reason
            outputs.append(self._retire(group))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the outputs of requests that got new tokens (with
        async scheduling: of the step before, while this one runs)."""
        start = time.perf_counter()
        self.pipeline.submit(self.scheduler.schedule(), start)
        if not self.pipeline.ready:
            return []  # async: the first step runs while the next one is scheduled
        outputs = self._take(self.pipeline.take())
        return outputs + self._drain_if_idle()

    def _drain_if_idle(self) -> list[RequestOutput]:
        """With no request left, take the step still in flight (async scheduling): nothing
        runs in the background of an idle engine."""
        outputs = []
        while self.pipeline and not self.groups:
            outputs += self._take(self.pipeline.take())
        return outputs

    def _take(self, step: Submitted) -> list[RequestOutput]:
        """A step's results: update the scheduler, detokenize, stop-check, trace."""
        scheduler_output = step.out
        try:
            runner_output = step.result()
        except TensorParallelError:
            raise  # a rank is gone: no later step can run
        except Exception as error:
            return self._fail_step(scheduler_output, error)
        self.num_consecutive_step_failures = 0
        for request_id, (position, entries) in runner_output.prompt_logprobs.items():
            entry = self._sequences.get(request_id)  # (not an id reused after an abort)
            if entry is not None and self.scheduler.live_request(scheduler_output, request_id):
                self._name_tokens(entries)
                entry[0].add_prompt_logprobs(position, entries)
        for request_id, vector in runner_output.embeddings.items():
            entry = self._sequences.get(request_id)
            if entry is not None and entry[0].embedding is None and \
                    self.scheduler.live_request(scheduler_output, request_id):
                entry[0].embedding = vector
        failed = self._fail_sequences(scheduler_output, runner_output.errors)
        updated = self.scheduler.update(scheduler_output, runner_output)
        outputs = self._emit(updated, runner_output, failed)  # (ends those a stop string ends)
        if self.step_trace is not None or self.trace_listener is not None:
            trace = self._trace_step(scheduler_output, updated, step.start)
            if self.step_trace is not None:
                self.step_trace.append(trace)
            if self.trace_listener is not None:
                self.trace_listener(trace)
        return outputs

    def _fail_sequences(self, out: SchedulerOutput, errors: dict[str, str]
                        ) -> list[RequestGroup]:
        """End the sequences the runner cannot go on with (their grammar failed) with
        finish_reason "error" and its reason, before the step's tokens are taken (theirs
        is dropped); the other samples of their request go on. Their groups."""
        groups = []
        for request_id, why in errors.items():
            entry = self._sequences.get(request_id)
            if entry is None or self.scheduler.live_request(out, request_id) is None:
                continue  # ended since the step was scheduled (async scheduling)
            group, seq = entry
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            logger.warning("request %s ends with finish_reason 'error': %s",
                           group.request_id, why)
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.flush()
            seq.finish_reason, seq.error = "error", why
            self._release_pending(group, seq)  # else n > 1 would wait for it forever
            groups.append(group)
        return groups

    def _emit(self, updated: list[Request], runner_output: ModelRunnerOutput,
              failed_alone: list[RequestGroup]) -> list[RequestOutput]:
        """Detokenize and stop-check the new tokens; the outputs of the requests touched
        (and of ``failed_alone``). A request whose post-processing raises (a bug, a
        tokenizer error) ends alone with finish_reason "error"."""
        touched: dict[str, RequestGroup] = {g.request_id: g for g in failed_alone}
        failed: list[RequestOutput] = []
        for request in updated:
            entry = self._sequences.get(request.request_id)
            if entry is None:
                continue  # a sibling sample failed earlier in this loop: the group is gone
            group, seq = entry
            try:
                self._on_tokens(group, seq, runner_output.logprobs.get(request.request_id))
            except Exception:
                logger.exception("request %s failed after its token", group.request_id)
                touched.pop(group.request_id, None)
                failed += self._end_requests([group.request_id], RequestStatus.FINISHED_ERROR)
                continue
            touched[group.request_id] = group
        return failed + [self._retire(g) if g.finished else g.output()
                         for g in touched.values()
                         if g.finished or g.params.output_kind != RequestOutputKind.FINAL_ONLY]

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The forward pass raised: end the requests it ran with finish_reason "error" and
        free their blocks (their KV may be half-written), keep serving the others.

        The scheduler's state is sound (``update`` did not run, so no block of this step
        was published to the prefix cache); the runner drops the failed requests' state at
        the next step (with async scheduling, the step after it was scheduled before the
        failure was known: the pipeline drops them from it). Raises after
        MAX_CONSECUTIVE_STEP_FAILURES failures in a row.
        """
        self.num_consecutive_step_failures += 1
        failed = {s.request_id for s in out.scheduled
                  if self.scheduler.live_request(out, s.request_id) is not None}
        self.scheduler.step_failed(out)
        # the copy of the swapped-out requests' KV to host may not have run (those
        # preempted for recompute lost nothing: they start again from their tokens)
        failed |= out.swapped_out_request_ids
        groups = {self._sequences[i][0].request_id for i in failed if i in self._sequences}
        outputs = self._end_requests(sorted(groups), RequestStatus.FINISHED_ERROR)
        if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self.num_consecutive_step_failures} engine steps failed in a "
                               "row; the engine cannot continue") from error
        logger.error("engine step %d failed; its %d request(s) end with finish_reason "
                     "'error': %s", out.step_id, len(groups), sorted(groups), exc_info=error)
        return outputs

    def _trace_step(self, out: SchedulerOutput, updated: list[Request],
                    start: float) -> StepTrace:
        """One step's decisions: who ran how many tokens (prefill or decode), who was
        preempted, who waited, who finished, and the KV blocks in use."""
        kv = self.scheduler.kv_cache
        return StepTrace(
            step=out.step_id, time=start, duration=time.perf_counter() - start,
            scheduled=tuple(ScheduledEntry(s.request_id, s.num_new_tokens, _step_kind(s))
                            for s in out.scheduled),
            preempted=tuple(sorted(out.preempted_request_ids)),
            waiting=tuple(r.request_id for r in self.scheduler.policy),
            finished=tuple(r.request_id for r in updated if r.status.finished),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
        )

    def _on_tokens(self, group: RequestGroup, seq: Sequence, logprobs: Any) -> None:
        """The step's new tokens of one sequence, in order (several when drafts were
        accepted): text, stop strings (the tokens after one are dropped), logprobs."""
        request = seq.request
        new = seq.new_token_ids()
        pooled = request.sampling_params.return_embedding  # its one token is dropped
        for i, token in enumerate(new):
            self.num_generation_tokens += not pooled
            lp = logprobs[i] if logprobs is not None else None
            if lp is not None:
                self._name_tokens([lp])
            if seq.add_token(token, lp, last=i == len(new) - 1) is not None:
                if not request.status.finished:
                    self.scheduler.finish_requests([request.request_id],
                                                   RequestStatus.FINISHED_STOPPED)
                elif request.status == RequestStatus.FINISHED_LENGTH:
                    # the stop string ended on or before the token that reached max_tokens
                    # (the scheduler has finished it): it stopped, as vLLM reports it
                    request.status = RequestStatus.FINISHED_STOPPED
                request.truncate_output(seq.num_tokens_seen)
                break
        if pooled and request.status == RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED  # done, as vLLM's pooling requests
        if request.status.finished:
            seq.finish_reason = request.status.finish_reason
        self._release_pending(group, seq)

    def _name_tokens(self, logprobs: list[dict[int, Logprob]]) -> None:
        """Each logprob entry's token as text (``Logprob.decoded_token``)."""
        if self.tokenizer is None:
            return
        for entries in logprobs:
            for token_id, entry in entries.items():
                text = self.tokenizer.token_text(token_id)
                entry.decoded_token = text
                if "\ufffd" in text:  # a piece of a character: its bytes, for the API
                    entry.decoded_bytes = self.tokenizer.token_bytes(token_id)

    def _release_pending(self, group: RequestGroup, seq: Sequence) -> None:
        """Once the first sample has its first token (or failed at it), its siblings run."""
        if group.pending and seq.index == 0:
            for pending in group.pending:  # the prompt's blocks are now cached: share them
                self.scheduler.add_request(pending)
            group.pending.clear()

    def _retire(self, group: RequestGroup) -> RequestOutput:
        output = group.output()
        del self.groups[group.request_id]
        for seq in group.sequences:
            self._sequences.pop(seq.request.request_id, None)
            if seq.finish_reason is not None:
                self.finished_by_reason[seq.finish_reason] += 1
        return output

    def block_map(self) -> BlockMap:
        """Who holds which KV block now (loop thread only, like every method that reads or
        changes the scheduler)."""
        return self.scheduler.kv_cache.block_map()

    def check_integrity(self) -> None:
        """KV invariants (with no request alive, every block is free)."""
        self.scheduler.check_integrity()


def _step_kind(s: ScheduledRequest) -> str:
    """A traced request-step: "verify" (a decode with drafts), "decode" or "prefill"."""
    if s.num_spec_tokens:
        return "verify"
    return "decode" if s.num_new_tokens == 1 and s.num_computed_tokens else "prefill"
