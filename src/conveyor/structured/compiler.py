"""Compile a request's constraint into an llguidance matcher: off the step loop, cached by
the constraint's text, bounded in size and in time.

``GrammarCompiler.compile`` is called by the server in a worker thread before the request
reaches the engine (and by ``LLMEngine.add_request``, which then hits the cache), so one
request's compile never stalls a step. A compile that outlives ``compile_timeout`` seconds
is a ValueError (the request gets a 400); its thread finishes in the background (a thread
cannot be killed, but llguidance bounds its work with fuel limits) and the failure stays
cached, so sending the schema again costs nothing.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

from conveyor.sampling_params import ReasoningSection, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from conveyor.tokenizer.tokenizer import Tokenizer

# Compiled grammars kept (least recently used evicted first).
GRAMMAR_CACHE_SIZE = 256
# Threads compiling at once: a hostile schema occupies one until llguidance's fuel runs out.
COMPILE_THREADS = 2
# JSON as the models in this field write it (Python's json.dumps separators), with no
# free whitespace: a small model offered "any whitespace" can emit newlines forever.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                    "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the grammar engine refused; the message starts with its kind
    ("json: ..."), ``detail`` is the rest."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class GrammarStats:
    """Cumulative counters of one compiler (the engine's stats carry them as grammar_*)."""

    num_compiles: int = 0  # grammars compiled (cache misses), failed ones too
    num_cache_hits: int = 0  # requests served from the cache (or an in-flight compile)
    num_compile_errors: int = 0  # invalid or unsupported constraints
    num_compile_timeouts: int = 0  # compiles that outlived compile_timeout
    compile_seconds: float = 0.0  # total time of the finished compiles


@dataclass
class _Entry:
    future: Future[llguidance.LLMatcher]
    started: float  # time.monotonic() when submitted
    # Made by an uncounted lookup (the server's compile ahead of adding the request): the
    # first counted lookup is the request that caused the compile, not a cache hit.
    unclaimed: bool = False


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar (ValueError naming the field when malformed)."""
    kind = spec.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)
    if kind == "json":
        assert isinstance(spec.json, str)  # StructuredOutputsParams stores a dict as text
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise GrammarError("json", f"the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("json", f"a JSON Schema is an object, got "
                               f"{type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":  # \d, \w, \s as ASCII classes (a model offered every Unicode
        # digit for \d writes exotic ones)
        lark = "start: /" + llguidance.regex_to_lark(spec.regex or "", "dws") + "/"
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice or ())))
    try:  # GBNF (llama.cpp's) or Lark (llguidance's); `%json {...}` embeds a schema
        return llguidance.grammar_from("grammar", spec.grammar or "")
    except ValueError as e:
        raise GrammarError("grammar", str(e)) from None


def lark_literal(tokenizer: Tokenizer, text: str) -> str:
    """``text`` in a Lark grammar: its token where the vocabulary has it as one (an added
    token such as Qwen's ``<tool_call>``: llguidance never reads one out of text, nor spells
    it out), else the text."""
    token_id = tokenizer.token_to_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def after_reasoning(grammar: str, section: ReasoningSection, tokenizer: Tokenizer,
                    free_answer: bool = False) -> str:
    """``grammar`` (a Lark grammar or llguidance's JSON) after free thinking in ``section``:
    the thinking runs to the end tag (no EOS before it; after ``section.budget`` tokens,
    only the end tag), up to 4 whitespace characters may follow (a model offered more can
    emit newlines forever), then ``grammar``'s output. When the prompt did not open the
    section, the output may skip it. ``free_answer`` (a thinking budget alone): any answer,
    ``grammar`` unused; one that cannot begin with the start tag, so that the matcher
    accepts only once the output is past the thinking (``bounds_thinking_only``)."""
    tag = functools.partial(lark_literal, tokenizer)
    end = tokenizer.token_to_id(section.end)
    if end is not None:  # any token but the end tag and EOS (added ones too: <tool_call>)
        banned = ",".join(map(str, (end, *tokenizer.eos_token_ids)))
        repeat = "*" if section.budget is None else f"{{0,{section.budget}}}"
        body = "" if section.budget == 0 else f"<[^{banned}]>{repeat} "
        thinking = f"think: {body}{tag(section.end)}"
    elif section.budget is not None:
        raise GrammarError("thinking_token_budget", f"{section.end} is not a token here")
    else:  # the shortest text up to the end tag
        thinking = "think[lazy]: /(.|\\n)*" + re.escape(section.end).replace("/", "\\/") + "/"
    start = "start: think gap? answer" if section.opened else \
        f"start: ({tag(section.start)} think gap?)? answer"
    lark = f"{start}\n{thinking}\ngap: /[ \\t\\r\\n]{{1,4}}/\n"
    start_id = tokenizer.token_to_id(section.start)
    if free_answer:
        if start_id is None:  # an answer could then begin as the thinking does
            raise GrammarError("thinking_token_budget", f"{section.start} is not a token here")
        return lark + f"answer: (<[^{start_id}]> <[*]>*)?\n"
    grammars = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") \
        else [{"lark_grammar": grammar}]
    grammars[0] = {**grammars[0], "name": "answer_grammar"}
    lark += "answer: @answer_grammar\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]})


class GrammarCompiler:
    """Constraint -> compiled matcher (copied per request), with a cache and a timeout."""

    def __init__(self, tokenizer: Tokenizer, compile_timeout: float, max_grammar_bytes: int
                 ) -> None:
        self.tokenizer = tokenizer
        self.compile_timeout = compile_timeout
        self.max_grammar_bytes = max_grammar_bytes
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, _Entry] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._stats = GrammarStats()

    @property
    def stats(self) -> GrammarStats:
        return self._stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                tok = self.tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend_json(), n_vocab=tok.vocab_size,
                    eos_token=list(tok.eos_token_ids) or None)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams, count: bool = True
                ) -> llguidance.LLMatcher:
        """A fresh matcher for one request. GrammarError (bad constraint, too large, too
        slow to compile) with a message that starts with the constraint's kind.

        ``count``: this lookup is the request's own (the engine adding it), counted in
        the cache statistics; the server's compile ahead of it and the runner's copy are not.
        """
        size = len(spec.json or spec.regex or spec.grammar or "") + sum(map(len, spec.choice or ()))
        if size > self.max_grammar_bytes:
            raise GrammarError(spec.kind, f"the constraint has {size} characters, more than "
                               f"the limit of {self.max_grammar_bytes} (max_grammar_bytes)")
        _ = self.ll_tokenizer  # built once (~1 s) outside any request's compile timeout
        entry = self._entry(spec, count)
        remaining = self.compile_timeout - (time.monotonic() - entry.started)
        try:
            matcher = entry.future.result(timeout=max(remaining, 0.0))
        except FutureTimeout:
            self._count(num_compile_timeouts=1)
            raise GrammarError(spec.kind, f"the grammar took longer than "
                               f"{self.compile_timeout:g} s to compile "
                               "(grammar_compile_timeout); simplify the constraint") from None
        return matcher.deep_copy()

    def _entry(self, spec: StructuredOutputsParams, count: bool) -> _Entry:
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                if count and not entry.unclaimed:
                    self._stats = _add(self._stats, num_cache_hits=1)
                entry.unclaimed = entry.unclaimed and not count
                return entry
            entry = _Entry(self._pool.submit(self._build, spec), time.monotonic(),
                           unclaimed=not count)
            self._cache[spec] = entry
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return entry

    def _build(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        start = time.perf_counter()
        try:
            text = grammar_text(spec)
            if spec.after_reasoning is not None:
                text = after_reasoning(text, spec.after_reasoning, self.tokenizer,
                                       free_answer=spec.bounds_thinking_only)
            matcher = llguidance.LLMatcher(self.ll_tokenizer, text)
            if matcher.is_error():
                raise GrammarError(spec.kind, matcher.get_error())
        except GrammarError:
            self._count(num_compile_errors=1)
            raise
        except ValueError as e:  # llguidance's own (a regex it cannot parse, ...)
            self._count(num_compile_errors=1)
            raise GrammarError(spec.kind, str(e)) from None
        finally:
            self._count(num_compiles=1, compile_seconds=time.perf_counter() - start)
        return matcher

    def _count(self, **deltas: float) -> None:
        with self._lock:
            self._stats = _add(self._stats, **deltas)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _add(stats: GrammarStats, **deltas: float) -> GrammarStats:
    return GrammarStats(**{k: v + deltas.get(k, 0) for k, v in vars(stats).items()})
