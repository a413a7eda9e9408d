"""Request generators for ``conveyor bench serve``: random, skewed, ShareGPT-like and ShareGPT
workloads.

No tokenizer is assumed (the server under test may be any OpenAI-compatible one), so prompt
lengths are hints: a random prompt of N tokens is N words from a list of common short English
words, each of which is one token for the usual BPE vocabularies (with its leading space).
The benchmark reports the prompt length the server's usage chunk gives, not the hint.
Every generator is seeded, so one seed gives the same workload on every machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASET_NAMES = ("random", "skewed", "sharegpt-like", "sharegpt", "reference", "json-schema")

# Common short English words: each is a single token (with its leading space) in the
# Llama-3, GPT-2/4, Qwen and SmolLM BPE vocabularies, so N words ≈ N prompt tokens.
PROMPT_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there use "
    "an each which she do how their if will up other about out many then them these so "
    "some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get "
    "come made may part over new sound take only little work know place year live me back "
    "give most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show"
).split()

# Output-length estimate for ShareGPT answers without a tokenizer: about 1.3 BPE tokens
# per English word (the usual rule of thumb: 100 tokens ≈ 75 words).
TOKENS_PER_WORD = 1.3
# ShareGPT entries shorter than this (prompt or answer, in estimated tokens) are skipped,
# as vLLM's sampler does: they measure the HTTP round trip more than the server.
MIN_SHAREGPT_TOKENS = 4


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark workload."""

    # the text sent as `prompt` (completions) or the user message (chat); token ids for the
    # `reference` dataset (completions only)
    prompt: str | list[int]
    prompt_len_hint: int  # estimated prompt tokens; the server's usage gives the real count
    output_len: int  # sent as `max_tokens`
    # json-schema dataset: the request's response_format (OpenAI's json_schema form)
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class SkewedMix:
    """The skewed workload: mostly short answers, some long ones, prompts of mixed length.

    Defaults: 80% of requests want 16–64 output tokens, 20% want 256; prompts are
    uniform in 50–300 tokens.
    """

    long_fraction: float = 0.2  # share of requests with `long_output_len` output tokens
    short_output_min: int = 16  # short requests: output length uniform in [min, max]
    short_output_max: int = 64
    long_output_len: int = 256
    prompt_min: int = 50  # every request: prompt length uniform in [min, max]
    prompt_max: int = 300

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"skewed long_fraction must be in [0, 1], got {self.long_fraction}")
        if not 1 <= self.short_output_min <= self.short_output_max:
            raise ValueError(
                "skewed short output range must satisfy 1 <= min <= max, got "
                f"[{self.short_output_min}, {self.short_output_max}]"
            )
        if self.long_output_len < 1:
            raise ValueError(f"skewed long_output_len must be >= 1, got {self.long_output_len}")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise ValueError(
                "skewed prompt range must satisfy 1 <= min <= max, got "
                f"[{self.prompt_min}, {self.prompt_max}]"
            )


@dataclass(frozen=True)
class DatasetConfig:
    """Which workload to generate; validated at construction."""

    name: str = "random"  # one of DATASET_NAMES
    num_prompts: int = 1000
    seed: int = 0
    input_len: int = 1024  # random: mean prompt tokens
    output_len: int = 128  # random: mean output tokens; json-schema: each request's max_tokens
    range_ratio: float = 0.0  # random: lengths uniform in [len*(1-r), len*(1+r)]
    skewed: SkewedMix = SkewedMix()
    dataset_path: str | None = None  # sharegpt: the JSON file
    sharegpt_output_len: int | None = None  # sharegpt: fixed output length instead of the answer's

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset must be one of {DATASET_NAMES}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}"
            )
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset 'sharegpt' needs dataset_path (--dataset-path FILE)")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"sharegpt_output_len must be >= 1, got {self.sharegpt_output_len}")


def random_prompt(rng: np.random.Generator, num_tokens: int) -> str:
    """A prompt of `num_tokens` words drawn from PROMPT_WORDS (≈ `num_tokens` BPE tokens)."""
    indices = rng.integers(0, len(PROMPT_WORDS), size=num_tokens)
    return " ".join(PROMPT_WORDS[i] for i in indices)


def _word_requests(rng: np.random.Generator, input_lens: np.ndarray, output_lens: np.ndarray
                   ) -> list[SampleRequest]:
    """Requests of random-word prompts of these lengths, drawn in order from `rng`."""
    return [
        SampleRequest(random_prompt(rng, int(n_in)), int(n_in), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, math.floor(mean * (1.0 - ratio)))
    high = max(low, math.ceil(mean * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
    """Random prompts; lengths uniform in [len*(1-r), len*(1+r)] (exactly `len` for r = 0)."""
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_prompts)
    return _word_requests(rng, input_lens, output_lens)


def sample_skewed_requests(
    num_prompts: int, mix: SkewedMix = SkewedMix(), seed: int = 0
) -> list[SampleRequest]:
    """The skewed mix: exactly round(long_fraction * n) long requests, shuffled among short."""
    rng = np.random.default_rng(seed)
    num_long = round(mix.long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[:num_long] = True
    rng.shuffle(is_long)
    short_lens = rng.integers(mix.short_output_min, mix.short_output_max + 1, size=num_prompts)
    output_lens = np.where(is_long, mix.long_output_len, short_lens)
    input_lens = rng.integers(mix.prompt_min, mix.prompt_max + 1, size=num_prompts)
    return _word_requests(rng, input_lens, output_lens)


@dataclass(frozen=True)
class ChatLengths:
    """The sharegpt-like workload: prompt and answer lengths drawn from lognormals, the
    heavy-tailed shape of chat logs (most prompts short, a few long pastes; answers of a few
    hundred tokens, some much longer). A stand-in when no ShareGPT file is at hand: its
    parameters are round numbers, not fitted to ShareGPT (`--dataset FILE.json` replays a
    real ShareGPT-format file). Defaults: prompts median 100 tokens (mean ~180, 1 % over
    ~1,300), answers median 180 (mean ~250, 1 % over ~1,150), each clipped to [4, max]."""

    prompt_median: int = 100
    prompt_sigma: float = 1.1
    prompt_max: int = 3072
    output_median: int = 180
    output_sigma: float = 0.8
    output_max: int = 2048


def sample_chat_like_requests(num_prompts: int, seed: int = 0,
                              lengths: ChatLengths = ChatLengths()) -> list[SampleRequest]:
    """The sharegpt-like workload (ChatLengths), random words as prompts."""
    rng = np.random.default_rng(seed)

    def draw(median: int, sigma: float, most: int) -> np.ndarray:
        values = rng.lognormal(math.log(median), sigma, size=num_prompts)
        return np.clip(np.rint(values), MIN_SHAREGPT_TOKENS, most).astype(np.int64)

    input_lens = draw(lengths.prompt_median, lengths.prompt_sigma, lengths.prompt_max)
    output_lens = draw(lengths.output_median, lengths.output_sigma, lengths.output_max)
    return _word_requests(rng, input_lens, output_lens)


def estimate_num_tokens(text: str) -> int:
    """Token count of English text without a tokenizer: words * 1.3, at least 1."""
    return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def _sharegpt_pair(entry: Any) -> tuple[str, str] | None:
    """(human prompt, gpt answer) of one ShareGPT entry, or None if it has no such pair."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("conversation")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    prompt, answer = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(answer, str)):
        return None
    return prompt, answer


def load_sharegpt_requests(
    path: str | Path, num_prompts: int, seed: int = 0, output_len: int | None = None
) -> list[SampleRequest]:
    """Requests from a ShareGPT-format JSON file (a list of {"conversations": [...]}).

    conversations[0] (human) is the prompt; the output length is the estimated token count of
    conversations[1] (gpt), or `output_len` when given. Entries are shuffled with `seed`;
    pairs shorter than MIN_SHAREGPT_TOKENS are skipped. Raises ValueError when the file holds
    fewer usable entries than `num_prompts`.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    order = np.random.default_rng(seed).permutation(len(data))
    requests: list[SampleRequest] = []
    for i in order:
        pair = _sharegpt_pair(data[i])
        if pair is None:
            continue
        prompt, answer = pair
        prompt_len = estimate_num_tokens(prompt)
        answer_len = output_len if output_len is not None else estimate_num_tokens(answer)
        if prompt_len < MIN_SHAREGPT_TOKENS or answer_len < MIN_SHAREGPT_TOKENS:
            continue
        requests.append(SampleRequest(prompt, prompt_len, answer_len))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(
        f"{path}: only {len(requests)} usable conversations, {num_prompts} requested "
        "(lower --num-prompts)"
    )


def reference_requests(num_prompts: int, seed: int,
                       vocab_size: int = 49152) -> list[SampleRequest]:
    """The offline benchmark's reference workload (`conveyor bench offline`) as token-id
    prompts, so online and offline throughput are measured on the very same requests."""
    from conveyor.bench.offline import Workload  # imports the engine: only for this dataset

    return workload_requests(Workload(num_requests=num_prompts, seed=seed), vocab_size)


def workload_requests(workload: Any, vocab_size: int) -> list[SampleRequest]:
    """An offline `Workload`'s requests as token-id SampleRequests."""
    return [SampleRequest(prompt=ids, prompt_len_hint=len(ids),
                          output_len=params.max_tokens or 0)
            for ids, params in workload.requests(vocab_size)]


# The json-schema dataset: what to describe, and schemas of the shapes APIs ask for (nested
# objects, arrays with bounds, enums, anyOf, bounded numbers, string patterns).
_JSON_SUBJECTS = ("a city", "a person", "a book", "a car", "a planet", "a restaurant",
                  "a movie", "a song")
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "rating": {"type": "number", "minimum": 0, "maximum": 5}},
        "required": ["name", "year", "rating"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "minItems": 1, "maxItems": 5},
        "kind": {"enum": ["fact", "opinion", "question"]}},
        "required": ["title", "tags", "kind"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0},
                         {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}]},
        "location": {"type": "object", "properties": {
            "country": {"type": "string", "maxLength": 40},
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["country", "lat", "lon"], "additionalProperties": False},
        "summary": {"type": "string", "maxLength": 200}},
        "required": ["id", "location", "summary"], "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 6, "items": {"type": "object", "properties": {
            "label": {"type": "string", "maxLength": 30},
            "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
            "required": ["label", "count"], "additionalProperties": False}},
        "done": {"type": "boolean"}},
        "required": ["items", "done"], "additionalProperties": False},
}


def sample_json_schema_requests(num_prompts: int, output_len: int,
                                seed: int) -> list[SampleRequest]:
    """Chat requests each asking for a JSON object of one of JSON_SCHEMAS (round robin
    over the schemas, subjects drawn with `seed`); `output_len` is max_tokens."""
    rng = np.random.default_rng(seed)
    names = list(JSON_SCHEMAS)
    requests = []
    for i in range(num_prompts):
        name = names[i % len(names)]
        subject = _JSON_SUBJECTS[int(rng.integers(len(_JSON_SUBJECTS)))]
        prompt = (f"Describe {subject} as a JSON object with the fields "
                  f"{', '.join(JSON_SCHEMAS[name]['properties'])}.")
        requests.append(SampleRequest(prompt, estimate_num_tokens(prompt), output_len, {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": JSON_SCHEMAS[name], "strict": True}}))
    return requests


def sample_requests(config: DatasetConfig) -> list[SampleRequest]:
    """The workload `config` describes."""
    if config.name == "random":
        return sample_random_requests(
            config.num_prompts, config.input_len, config.output_len, config.range_ratio,
            config.seed,
        )
    if config.name == "skewed":
        return sample_skewed_requests(config.num_prompts, config.skewed, config.seed)
    if config.name == "sharegpt-like":
        return sample_chat_like_requests(config.num_prompts, config.seed)
    if config.name == "reference":
        return reference_requests(config.num_prompts, config.seed)
    if config.name == "json-schema":
        return sample_json_schema_requests(config.num_prompts, config.output_len, config.seed)
    assert config.dataset_path is not None  # checked in DatasetConfig.__post_init__
    return load_sharegpt_requests(
        config.dataset_path, config.num_prompts, config.seed, config.sharegpt_output_len
    )
