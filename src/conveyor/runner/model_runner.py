"""SchedulerOutput -> tensors -> one forward pass -> sampled tokens.

The runner never decides who runs. It keeps, per request, the tokens it feeds the model and
the sampler's state; it lays out the step's tokens flat and unpadded (decodes first, then
prefill chunks), computes positions and KV slots, and samples only where a request reached
the end of its input. A request verifying drafted tokens lays out its last token plus the
drafts as consecutive decode rows (each attends to the positions up to its own, the rows
before it included), so a step of decodes and verifies takes the decode-only path; every
row's logits go to ``Sampler.verify``.

``launch`` runs a step up to its sampled tokens on the device and returns a ``PendingStep``
whose ``result()`` waits for them (``execute`` does both). With async scheduling the engine
launches step N+1 before it takes N's result: a decode whose input is N's token (not on the
host yet) gets it on the device, from N's sampled ids. A request whose next step needs N's
tokens on the host (a grammar, drafts) has N's result taken first; the sampler reads a
pending token on the device too (penalties, min_tokens).
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from llguidance import LLMatcher

from conveyor.attention.metadata import AttentionMetadata, HostSequences, PrefillChunk
from conveyor.config import CacheConfig, ModelConfig
from conveyor.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from conveyor.model.llama import CausalLM
from conveyor.ops import OpsBackend
from conveyor.ops.reference import kv_cache_shape, tiles_as_rows
from conveyor.ops.transfer import upload
from conveyor.runner.cuda_graphs import SCRATCH_BLOCKS, CudaGraphRunner, CudaGraphSpec
from conveyor.runner.sampler import (
    Sampled,
    Sampler,
    SamplingState,
    make_generator,
    token_logprobs,
)
from conveyor.sampling_params import SamplingParams
from conveyor.structured.bitmask import BitmaskFiller, apply_token_bitmask

if TYPE_CHECKING:
    from conveyor.runner.draft import DraftModelProposer
    from conveyor.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class KVCacheLayout:
    """How the KV memory budget becomes blocks."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    num_swap_blocks: int = 0  # host blocks for swap preemption
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8"
    # Of bytes_per_token, the draft model's own K/V (speculative decoding with a draft
    # model): its cache has the same blocks, so the budget pays both per token.
    draft_bytes_per_token: int = 0
    # The tile layout (conveyor.ops.reference.is_tiles): same bytes, stored for bf16 products.
    tiles: bool = False

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def num_swap_bytes(self) -> int:
        return self.num_swap_blocks * self.block_size * self.bytes_per_token

    @classmethod
    def from_budget(cls, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                    swap: bool = False, draft: ModelConfig | None = None,
                    tiles: bool = False) -> KVCacheLayout:
        """Blocks of the budget; with a ``draft`` model, a block holds both models' K/V.
        ``tiles``: the backend reads the tile layout (``OpsBackend.kv_cache_tiles``); the
        cache takes it where every model's head_dim and the block size fit it."""
        if cache.kv_cache_dtype == "int8" and cache.block_size % 16:
            raise ValueError(f"kv_cache_dtype='int8' needs a block_size divisible by 16, got "
                             f"{cache.block_size}")
        draft_per_token = 0 if draft is None else \
            _kv_bytes_per_token(draft, cache, dtype, "the draft model's (speculative_config."
                                "model)")
        per_token = _kv_bytes_per_token(model, cache, dtype, "the model's") + draft_per_token
        num_blocks = cache.kv_cache_memory // (per_token * cache.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block of "
                             f"{cache.block_size} tokens at {per_token} bytes per token")
        num_swap = cache.swap_space // (per_token * cache.block_size) if swap else 0
        tiles = (tiles and cache.kv_cache_dtype == "auto" and cache.block_size % 16 == 0
                 and all(m.head_dim % 32 == 0 and m.head_dim <= 256
                         for m in (model, draft) if m is not None))
        return cls(num_blocks, cache.block_size, per_token, num_swap, cache.kv_cache_dtype,
                   draft_per_token, tiles)


def _kv_bytes_per_token(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                        whose: str) -> int:
    if cache.kv_cache_dtype == "int8" and model.head_dim % 4:
        raise ValueError(f"kv_cache_dtype='int8' needs a head_dim divisible by 4, {whose} is "
                         f"{model.head_dim}")
    element, shape = kv_cache_shape(1, cache.block_size, model.num_key_value_heads,
                                    model.head_dim, cache.kv_cache_dtype, dtype)
    return model.num_hidden_layers * math.prod(shape) * element.itemsize // cache.block_size


def allocate_kv_caches(model: CausalLM, layout: KVCacheLayout, device: torch.device,
                       extra_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s paged K/V on ``device`` and its host swap space (indexed alike), zeroed;
    ``extra_blocks`` past the layout's (the CUDA graphs' scratch block) on the device.

    [layers, 2 (K, V), blocks, block_size, KVH, D] (int8: [layers, 2, blocks, KVH,
    block_size * (D + 4)]; the tile layout: [layers, 2, blocks, KVH, block_size * D]; see
    conveyor.ops.reference)."""
    cfg = model.config

    def cache(num_blocks: int, device: torch.device | str, setting: str,
              **kwargs: Any) -> torch.Tensor:
        dtype, shape = kv_cache_shape(num_blocks, layout.block_size, cfg.num_key_value_heads,
                                      cfg.head_dim, layout.kv_cache_dtype,
                                      model.embed_tokens.weight.dtype, layout.tiles)
        try:
            tensor = torch.empty(cfg.num_hidden_layers, *shape, dtype=dtype, device=device,
                                 **kwargs)
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory errors included
            size = cfg.num_hidden_layers * math.prod(shape) * dtype.itemsize
            raise ValueError(f"{setting}: cannot allocate {size / 2**30:.2f} GiB of KV cache "
                             f"on {device} (out of memory); lower it") from e
        # Pre-fault: write every page now. An allocator may hand out untouched pages (mmap,
        # calloc) that the OS backs only when first written, i.e. as the free list cycles
        # through the blocks under load: memory would then grow for hours and a machine
        # without it would fail late. Written here, the memory the engine logs at start is
        # the memory it holds, and too little fails at start.
        return tensor.zero_()

    return cache(layout.num_blocks + extra_blocks, device, "kv_cache_memory"), cache(
        layout.num_swap_blocks, "cpu", "swap_space",
        pin_memory=device.type == "cuda" and layout.num_swap_blocks > 0)


# Prompt rows scored at once for prompt_logprobs: each holds the vocabulary's logits (and
# their float32 log-softmax), so a long chunk is scored in slices.
PROMPT_LOGPROBS_ROWS = 256


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, device: torch.device,
                 seed: int = 0, grammars: GrammarCompiler | None = None,
                 sampling: bool = True, drafter: DraftModelProposer | None = None,
                 cuda_graphs: CudaGraphSpec | None = None, forced_drafts: bool = True) -> None:
        self.model = model
        flashinfer = getattr(model.backend, "attention", None) == "flashinfer"
        # No graphs over FlashInfer: its plan reads the step's page lists on the host, which a
        # graph cannot capture (its CUDA-graph wrapper, planned before each replay, is not
        # wired in); the Triton kernel and the reference ops capture.
        if cuda_graphs is not None and flashinfer:
            logger.warning("CUDA graphs off: the FlashInfer attention path cannot be captured "
                           "yet (without flashinfer installed, the Triton kernel runs, with graphs)")
            cuda_graphs = None
        # False on tensor-parallel ranks other than 0: they run the model (its collectives)
        # and keep the tokens in step with rank 0's samples (``add_sampled``), but rank 0
        # alone samples.
        self.sampling = sampling
        self.device = device
        self.layout = layout
        self.block_size = layout.block_size
        # kv_caches, and the host copies of swapped-out blocks, indexed like them
        self.kv_caches, self.swap_space = allocate_kv_caches(
            model, layout, device, SCRATCH_BLOCKS if cuda_graphs is not None else 0)
        # Decode-only steps replay a captured graph (CUDA; captured now, the cache exists)
        self.graphs = None if cuda_graphs is None else CudaGraphRunner(
            model, self.kv_caches, cuda_graphs, layout.num_blocks, layout.block_size)
        if self.graphs is not None:
            self.graphs.capture()
        # A verify's rows attend as decode rows (see _is_decode), except over the int8 cache
        self.verify_as_decodes = layout.kv_cache_dtype != "int8"
        # Speculative decoding with a draft model: its own K/V under the same block tables
        self.drafter = drafter
        self.sampler = Sampler(device, seed, model.backend)
        self.states: dict[str, SamplingState] = {}
        self.tokens: dict[str, list[int]] = {}  # prompt + outputs as the model has seen them
        self.prompt_lens: dict[str, int] = {}
        # Structured outputs: the compiler, and each constrained request's matcher (kept
        # across preemption, like the sampler state: its outputs are kept too).
        self.grammars = grammars
        self.matchers: dict[str, LLMatcher] = {}
        # Report the tokens each grammar forces next (the scheduler drafts them)
        self.forced_drafts = forced_drafts
        self._bitmasks: BitmaskFiller | None = None  # made on the first constrained step
        # request id -> the launched step whose result has its next token, and its row
        self._pending: dict[str, tuple[PendingStep, int]] = {}
        # Give the attention metadata the host's list of sequences (FlashInfer plans from it
        # without waiting for the device; tests set it on CPU)
        self.host_sequences = flashinfer

    def use_backend(self, backend: OpsBackend) -> None:
        """Run the model and the sampler with these ops (``conveyor.ops.select_backend``
        chose at load; ``ReferenceBackend()`` for a comparison). A cache in the tile layout
        is copied back to rows for a backend that does not read it natively (the reference
        then runs on its own layout, not on one laid out for AMX), its contents kept."""
        if self.layout.tiles and not backend.kv_cache_tiles:
            self.layout = replace(self.layout, tiles=False)
            d = self.model.config.head_dim
            self.kv_caches, self.swap_space = (tiles_as_rows(x, d)
                                               for x in (self.kv_caches, self.swap_space))
            if self.drafter is not None:
                d = self.drafter.model.config.head_dim
                self.drafter.kv_caches, self.drafter.swap_space = (
                    tiles_as_rows(x, d)
                    for x in (self.drafter.kv_caches, self.drafter.swap_space))
        self.model.use_backend(backend)
        self.sampler.backend = backend
        if self.drafter is not None:
            self.drafter.model.use_backend(backend)
        if self.graphs is not None:  # the graphs launch the old backend's kernels
            self.graphs.capture()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Run one step up to its sampled tokens on the device; their copy to the host is
        started, ``result()`` waits for it (the step's one device sync)."""
        self._take_results_needed(out)
        self._forget(out.finished_request_ids)
        self._copy_blocks(out)
        self._add_requests(out)
        if out.is_empty:
            return PendingStep.done(ModelRunnerOutput({}))
        # Decodes first: the attention backend batches them together.
        batch = sorted(out.scheduled, key=lambda s: not self._is_decode(s))
        draft_seconds = 0.0
        if self.drafter is not None:  # the draft model proposes the verifies' drafts
            started = time.perf_counter()
            batch = self.drafter.propose(batch, self._prepare)
            draft_seconds = time.perf_counter() - started
        input_ids, positions, meta = self._prepare(batch)
        samplers = [s for s in batch if s.samples]
        masks = self._start_bitmasks(samplers)  # filled while the forward pass runs
        ends = np.cumsum([s.num_new_tokens for s in batch])
        # A sampling request's rows: its last token's, after its drafts' (a verify).
        rows = [r for i, s in enumerate(batch) if s.samples
                for r in range(int(ends[i]) - len(s.spec_token_ids) - 1, int(ends[i]))]
        keep = None
        if self.graphs is not None and self.graphs.eligible(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:  # mixed prefill + decode steps (and any step without graphs) run eagerly
            # Only the sampling rows' hidden states are needed, unless a prompt's logprobs are.
            if 0 < len(rows) < len(input_ids) and not self._wants_prompt_logprobs(batch):
                keep = self._upload(rows)
            hidden = self.model.step(input_ids, positions, self.kv_caches, meta, keep)
        prompt_logprobs = self._prompt_logprobs(batch, ends, hidden) if keep is None else {}
        if not samplers:
            return PendingStep.done(ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs))
        if keep is None and len(rows) < hidden.shape[0]:  # else every token samples: all rows
            hidden = hidden[self._upload(rows)]
        logits = self.model.compute_logits(hidden)
        if not self.sampling:
            return PendingStep.done(ModelRunnerOutput({}))
        embeddings = self._embeddings(samplers, hidden)
        if masks is not None:
            self._apply_masks(logits, masks, samplers)
        states = [self.states[s.request_id] for s in samplers]
        if self.drafter is None and not any(s.spec_token_ids for s in samplers):
            # (a token still on the device counts: min_tokens' ban and the penalties)
            views = [st.with_pending(self._pending_token(s.request_id))
                     if s.request_id in self._pending else st
                     for s, st in zip(samplers, states, strict=True)]
            return self._pending_step(samplers, states, self.sampler.sample(logits, views),
                                      prompt_logprobs, embeddings)
        # Drafts to verify: the sampler decides row by row on the host
        sampled = self.sampler.verify(logits, states, [s.spec_token_ids for s in samplers])
        result = self._record(samplers, states, sampled)
        result.draft_seconds, result.prompt_logprobs = draft_seconds, prompt_logprobs
        result.embeddings = embeddings.lists() if embeddings is not None else {}
        if self.drafter is not None:  # how far each verify's draft K/V is now valid
            self.drafter.record(samplers, result)
        return PendingStep.done(result)

    def _forget(self, request_ids: set[str]) -> None:
        """Drop what the runner keeps of finished requests."""
        for request_id in request_ids:
            self.states.pop(request_id, None)
            self.tokens.pop(request_id, None)
            self.prompt_lens.pop(request_id, None)
            self.matchers.pop(request_id, None)
            self._pending.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(request_id)

    def _pending_step(self, samplers: list[ScheduledRequest], states: list[SamplingState],
                      sampled: Sampled, prompt_logprobs: dict[str, Any],
                      embeddings: Embeddings | None = None) -> PendingStep:
        """A step's one token per request, on the device: the next step may read them there
        (``_prepare``) before ``result()`` brings them to the host (with the step's prompt
        logprobs, computed already)."""
        sampled.start_copy()
        step = PendingStep(self, samplers, states, sampled)
        step.prompt_logprobs, step.embeddings = prompt_logprobs, embeddings
        for i, s in enumerate(samplers):
            self._pending[s.request_id] = (step, i)
        return step

    @staticmethod
    def _apply_masks(logits: torch.Tensor, masks: tuple[list[int], Future[torch.Tensor]],
                     samplers: list[ScheduledRequest]) -> None:
        """The grammar masks on every row of a constrained request (a verify: 1 + drafts)."""
        constrained, bitmask = masks
        first = _first_rows(samplers)
        apply_token_bitmask(logits, bitmask.result(),
                            [r for i in constrained for r in range(first[i], first[i + 1])])

    def _embeddings(self, samplers: list[ScheduledRequest], hidden: torch.Tensor
                    ) -> Embeddings | None:
        """The prompt embeddings of the requests that asked (return_embedding) and sample
        their first token now: the final hidden state of the prompt's last token (each
        sampler's first row of ``hidden``), L2-normalized, in float32; their copy to the
        host started (the step's one wait, in ``result()``, covers it)."""
        wanted = [(i, s.request_id) for i, s in enumerate(samplers)
                  if (state := self.states[s.request_id]).params.return_embedding
                  and not state.output_token_ids]
        if not wanted:
            return None
        first = _first_rows(samplers)
        vectors = torch.nn.functional.normalize(
            hidden[self._upload([first[i] for i, _ in wanted])].float(), dim=-1)
        if vectors.device.type == "cuda":  # pinned: the copy runs behind the sampling
            vectors = torch.empty(vectors.shape, pin_memory=True).copy_(vectors,
                                                                        non_blocking=True)
        return Embeddings([request_id for _, request_id in wanted], vectors)

    def _wants_prompt_logprobs(self, batch: list[ScheduledRequest]) -> bool:
        """Whether a request of the batch asked for its prompt's logprobs."""
        return any((state := self.states.get(s.request_id)) is not None
                   and state.params.prompt_logprobs is not None for s in batch)

    def _prompt_logprobs(self, batch: list[ScheduledRequest], ends: np.ndarray,
                         hidden: torch.Tensor) -> dict[str, tuple[int, list[dict[int, Any]]]]:
        """For the requests with prompt_logprobs whose prompt this step's chunk computes:
        (p, the logprobs of prompt tokens p, p + 1, ...), scored by the rows before them."""
        result: dict[str, tuple[int, list[dict[int, Any]]]] = {}
        for i, s in enumerate(batch):
            state = self.states.get(s.request_id)
            if state is None or state.params.prompt_logprobs is None:
                continue
            start = s.num_computed_tokens  # row `start` scores prompt token start + 1
            stop = min(start + s.num_new_tokens, self.prompt_lens[s.request_id] - 1)
            if stop <= start:
                continue
            first, entries = int(ends[i]) - s.num_new_tokens - start, []
            for lo in range(start, stop, PROMPT_LOGPROBS_ROWS):  # a vocabulary per row: slices
                hi = min(lo + PROMPT_LOGPROBS_ROWS, stop)
                logits = self.model.compute_logits(hidden[first + lo:first + hi])
                if not self.sampling:  # (tensor parallel: the LM head's all-gather needs
                    continue  # every rank; rank 0 scores)
                targets = self._upload(self.tokens[s.request_id][lo + 1:hi + 1])
                entries += token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets,
                                          state.params.prompt_logprobs)
            if self.sampling:
                result[s.request_id] = (start + 1, entries)
        return result

    def _take_results_needed(self, out: SchedulerOutput) -> None:
        """Take the result of a launched step now if this one needs its tokens on the host:
        a grammar mask and bad words depend on the tokens so far, and a chunk or a verify
        lays its tokens out on the host."""
        for s in out.scheduled:
            entry = self._pending.get(s.request_id)
            if entry is None:
                continue
            if s.num_new_tokens > 1 or s.num_spec_tokens or s.request_id in self.matchers \
                    or self.states[s.request_id].params.bad_words_token_ids:
                entry[0].result()

    def _pending_token(self, request_id: str) -> torch.Tensor:
        """[1]: the request's token a launched step sampled, on the device."""
        step, index = self._pending[request_id]
        return step.tokens[index:index + 1]

    def _finish(self, step: PendingStep) -> ModelRunnerOutput:
        """A launched step's tokens on the host, and the runner's state after them."""
        assert step.sampled is not None
        tokens, logprobs = step.sampled.to_host()
        live = []  # (a request ended since, or its id reused: its token changes nothing)
        for i, s in enumerate(step.samplers):
            if self._pending.get(s.request_id, (None, 0))[0] is step:
                del self._pending[s.request_id]
            live.append(self.states.get(s.request_id) is step.states[i])
        samplers = [s for s, ok in zip(step.samplers, live, strict=True) if ok]
        states = [st for st, ok in zip(step.states, live, strict=True) if ok]
        sampled = [([t], [lp]) for t, lp, ok in zip(tokens, logprobs, live, strict=True) if ok]
        return self._record(samplers, states, sampled)

    def _record(self, samplers: list[ScheduledRequest], states: list[SamplingState],
                sampled: list[tuple[list[int], list[Any]]]) -> ModelRunnerOutput:
        """Each request's new tokens (accepted drafts, then the one sampled after them) into
        its state: tokens, sampler state, grammar; the step's output."""
        result = ModelRunnerOutput({})
        for s, state, (tokens, logprobs) in zip(samplers, states, sampled, strict=True):
            state.output_token_ids.extend(tokens)
            self.tokens[s.request_id].extend(tokens)
            result.sampled_token_ids[s.request_id] = tokens
            if logprobs[0] is not None:
                result.logprobs[s.request_id] = logprobs  # type: ignore[assignment]
            if (matcher := self.matchers.get(s.request_id)) is None:
                continue
            if matcher.is_error():  # its mask failed (out of fuel): the engine ends it
                why = matcher.get_error().split("\n", 1)[0]  # then a dump of its state
                result.errors[s.request_id] = f"structured output failed: {why}"
            elif not matcher.is_stopped():  # (ended: its mask allowed EOS alone, and a
                # token consumed past the end would fail it: a step past EOS, which async
                # scheduling runs, must not)
                matcher.consume_tokens(tokens)
                if _answer_is_free(state.params, matcher):
                    del self.matchers[s.request_id]
                elif self.forced_drafts and (forced := matcher.compute_ff_tokens()):
                    result.forced_token_ids[s.request_id] = forced
        return result

    def add_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Tokens another rank sampled last step (tensor parallelism): the inputs of this
        step's decodes, as if this runner had sampled them."""
        for request_id, tokens in sampled.items():
            if request_id in self.tokens:
                self.tokens[request_id].extend(tokens)

    def _add_requests(self, out: SchedulerOutput) -> None:
        for new in out.new_requests:
            if self.drafter is not None:  # its blocks may be new: draft K/V from scratch
                self.drafter.forget(new.request_id)
            self.tokens[new.request_id] = list(new.all_token_ids)
            self.prompt_lens[new.request_id] = new.num_prompt_tokens
            if new.request_id in self.states:
                continue  # resumed after preemption: keep its sampler state (seeded RNG)
            p = new.sampling_params
            self.states[new.request_id] = SamplingState(
                p, list(new.all_token_ids[:new.num_prompt_tokens]),
                list(new.all_token_ids[new.num_prompt_tokens:]),
                make_generator(p, self.device), new.eos_token_ids)
            if p.structured_outputs is not None and self.sampling:
                if self.grammars is None:
                    raise ValueError("structured_outputs needs a model with a tokenizer")
                matcher = self.grammars.compile(p.structured_outputs, count=False)  # cached
                output = list(new.all_token_ids[new.num_prompt_tokens:])
                matcher.consume_tokens(output)
                if not (output and _answer_is_free(p, matcher)):
                    self.matchers[new.request_id] = matcher

    def _start_bitmasks(self, samplers: list[ScheduledRequest]
                        ) -> tuple[list[int], Future[torch.Tensor]] | None:
        """The rows of the step's constrained requests, and their masks being filled."""
        rows = [i for i, s in enumerate(samplers) if s.request_id in self.matchers]
        if not rows:
            return None
        if self._bitmasks is None:
            assert self.grammars is not None
            tok = self.grammars.tokenizer
            self._bitmasks = BitmaskFiller(tok.vocab_size, tuple(tok.eos_token_ids))
        matchers = [self.matchers[samplers[i].request_id] for i in rows]
        return rows, self._bitmasks.start(matchers, [samplers[i].spec_token_ids for i in rows])

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """Swap-outs (device -> host) first, then swap-ins: a freed block may be reused.
        The draft model's K/V (if any) move with the target's: same blocks, own tensors."""
        caches = [(self.kv_caches, self.swap_space)]
        if self.drafter is not None:
            caches.append((self.drafter.kv_caches, self.drafter.swap_space))
        if out.swap_out:
            dev, host = (torch.tensor(x, device=self.device) for x in zip(*out.swap_out, strict=True))
            for kv, swap in caches:
                swap[:, :, host.to(swap.device)] = kv[:, :, dev].to(swap.device)
        if out.swap_in:
            host, dev = (torch.tensor(x, device=self.device) for x in zip(*out.swap_in, strict=True))
            for kv, swap in caches:
                kv[:, :, dev] = swap[:, :, host.to(swap.device)].to(self.device)

    def _is_decode(self, s: ScheduledRequest) -> bool:
        """One generated token's step, or a verify's (its last token and its drafts: one
        decode row each, attending to the rows before it, whose K/V every attention path
        writes before any decode row reads; but the int8 cache's CPU kernel writes each
        row's K/V within its own attention task, so there a verify stays a chunk). A
        prompt's last token alone (its chunking left it for a step of its own) stays a
        prefill chunk: every prompt token then goes through the same attention kernel, so
        prompts' KV do not depend on how they were chunked."""
        if s.num_computed_tokens < self.prompt_lens[s.request_id]:
            return False
        return s.num_new_tokens == 1 or (s.num_new_tokens == s.num_spec_tokens + 1
                                         and self.verify_as_decodes)

    def _prepare(self, batch: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        # Decodes (first in the batch) in plain Python: per request, numpy costs more than
        # the arithmetic; prefill chunks as arrays.
        decode_pos: list[int] = []
        decode_slots: list[int] = []
        pos_parts, slot_parts = [], []
        prefills: list[PrefillChunk] = []
        chunk_rows: list[ScheduledRequest] = []  # the request of each prefill chunk
        decode_rows: list[ScheduledRequest] = []  # the request of each decode row
        on_device: list[tuple[int, PendingStep, int]] = []  # (row, launched step, its row)
        for s in batch:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            if self._is_decode(s):  # a decode row per token (a verify: 1 + drafts)
                tokens = self.tokens[s.request_id]
                if start == len(tokens):  # the token a launched step samples (async)
                    on_device.append((len(ids), *self._pending[s.request_id]))
                    ids.append(0)
                else:
                    ids.append(tokens[start])
                ids.extend(s.spec_token_ids)
                for row_pos in range(start, end):
                    decode_pos.append(row_pos)
                    decode_slots.append(s.block_ids[row_pos // bs] * bs + row_pos % bs)
                    decode_rows.append(s)
                continue
            ids.extend(self.tokens[s.request_id][start:end - len(s.spec_token_ids)])
            ids.extend(s.spec_token_ids)
            pos = np.arange(start, end)
            table = np.asarray(s.block_ids)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            generated = max(0, end - max(start, self.prompt_lens[s.request_id]))
            table_t = None
            if start > 0 or generated:
                table_t = self._upload(s.block_ids[:-(-end // bs)])
            chunk_rows.append(s)
            prefills.append(PrefillChunk(len(ids) - s.num_new_tokens, s.num_new_tokens,
                                         start, table_t, generated))
        pos_parts.insert(0, np.array(decode_pos, dtype=np.int64))
        slot_parts.insert(0, np.array(decode_slots, dtype=np.int64))
        positions = self._upload(np.concatenate(pos_parts))
        slot_mapping = self._upload(np.concatenate(slot_parts))
        input_ids = self._upload(ids)
        for step in {step for _, step, _ in on_device}:  # (the last step's, in practice)
            rows = [(row, index) for row, s, index in on_device if s is step]
            input_ids[self._upload([r for r, _ in rows])] = \
                step.tokens[self._upload([i for _, i in rows])].to(input_ids.dtype)
        decode_tables, decode_lens = self._decode_context(decode_rows, decode_pos)
        meta = AttentionMetadata(slot_mapping, len(decode_rows), decode_tables, decode_lens,
                                 prefills)
        if self.host_sequences:  # for a planner on the host (FlashInfer's)
            meta.host = self._host_sequences(decode_rows, decode_pos, chunk_rows)
        return input_ids, positions, meta

    def _host_sequences(self, decode_rows: list[ScheduledRequest], decode_pos: list[int],
                        chunk_rows: list[ScheduledRequest]) -> HostSequences:
        """The step's sequences as ``AttentionMetadata.host`` lists them: each decode row
        (its position + 1 keys), then each prefill chunk (its prefix and itself)."""
        bs = self.block_size
        seqs = [(pos + 1, s.block_ids, 1) for s, pos in zip(decode_rows, decode_pos,
                                                           strict=True)]
        seqs += [(s.num_computed_tokens + s.num_new_tokens, s.block_ids, s.num_new_tokens)
                 for s in chunk_rows]
        return HostSequences([n for n, _, _ in seqs],
                             [table[:-(-n // bs)] for n, table, _ in seqs],
                             [q for _, _, q in seqs])

    def _decode_context(self, rows: list[ScheduledRequest], positions: list[int]
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block tables [R, max_blocks] of the decode rows and their context lengths [R]
        (a row at position p attends to p + 1 positions, its own included)."""
        if not rows:
            return None, None
        bs = self.block_size
        ctx_lens = np.array(positions) + 1
        max_blocks = -(-int(ctx_lens.max()) // bs)
        tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        for i, s in enumerate(rows):
            n = min(len(s.block_ids), max_blocks)
            tables[i, :n] = s.block_ids[:n]
        return self._upload(tables), self._upload(ctx_lens)

    def _upload(self, host: np.ndarray | list[int]) -> torch.Tensor:
        """Host integers as an int64 tensor on the device (``transfer.upload``)."""
        return upload(host, self.device, torch.int64)


def _first_rows(samplers: list[ScheduledRequest]) -> list[int]:
    """Where each sampling request's rows begin among the step's sampled rows (1 + its
    drafts each), and where they end: one more offset than requests."""
    return np.cumsum([0] + [len(s.spec_token_ids) + 1 for s in samplers]).tolist()


def _answer_is_free(params: SamplingParams, matcher: LLMatcher) -> bool:
    """A thinking budget's grammar that has reached the answer (after an output token: it
    accepts): the rest is free, so the matcher goes (it would stop at the answer's EOS and
    then allow only EOS, under ignore_eos too)."""
    spec = params.structured_outputs
    return spec is not None and spec.bounds_thinking_only and matcher.is_accepting()


@dataclass
class Embeddings:
    """A step's prompt embeddings: one row per request, on the host (or on their way)."""

    request_ids: list[str]
    vectors: torch.Tensor  # [len(request_ids), hidden], float32

    def lists(self) -> dict[str, list[float]]:
        rows: list[list[float]] = self.vectors.tolist()
        return dict(zip(self.request_ids, rows, strict=True))


class PendingStep:
    """A launched step: its output once ``result()`` has brought its tokens to the host."""

    def __init__(self, runner: ModelRunner | None, samplers: list[ScheduledRequest],
                 states: list[SamplingState], sampled: Sampled | None,
                 output: ModelRunnerOutput | None = None) -> None:
        self._runner = runner
        self.samplers = samplers
        self.states = states  # the sampler states at launch (a reused id gets new ones)
        self.sampled = sampled
        self._output = output
        self.prompt_logprobs: dict[str, tuple[int, list[dict[int, Any]]]] = {}
        self.embeddings: Embeddings | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> PendingStep:
        return cls(None, [], [], None, output)

    @property
    def tokens(self) -> torch.Tensor:
        """The sampled ids [len(samplers)], on the device."""
        assert self.sampled is not None
        return self.sampled.tokens

    def result(self) -> ModelRunnerOutput:
        """The step's output (waits for the device once; the runner's state follows)."""
        if self._output is None:
            assert self._runner is not None
            self._output = self._runner._finish(self)
            self._output.prompt_logprobs = self.prompt_logprobs
            if self.embeddings is not None:
                self._output.embeddings = self.embeddings.lists()
        return self._output
