"""Offline inference with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.stats import EngineStats
from conveyor.ops.openmp import release_openmp_threads
from conveyor.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from conveyor.sampling_params import EMBEDDING_PARAMS, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# vLLM's LLM(...) arguments that mean nothing here (no remote code or Hub downloads, the KV
# cache sized by kv_cache_memory, no compilation settings): taken with a warning, so that a
# vLLM script's constructor runs; any other unknown name is still an error (a typo).
VLLM_IGNORED_ARGS = frozenset({
    "trust_remote_code", "gpu_memory_utilization", "disable_log_stats", "tokenizer_mode",
    "revision", "tokenizer_revision", "code_revision", "download_dir", "hf_token",
    "compilation_config", "disable_custom_all_reduce", "max_seq_len_to_capture",
    "allowed_local_media_path", "max_logprobs"})


class LLM:
    """A model behind the continuous-batching engine, driven to completion per call.

    Every engine argument is a keyword: ``LLM(model=..., max_num_seqs=..., block_size=...,
    kv_cache_memory=..., max_model_len=..., dtype=..., load_format=...)``.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        ignored = sorted(set(engine_args) & VLLM_IGNORED_ARGS)
        if ignored:
            logger.warning("vLLM's argument(s) %s mean nothing to conveyor: ignored (the KV "
                           "cache is sized by kv_cache_memory)", ignored)
        engine_args = {k: v for k, v in engine_args.items() if k not in VLLM_IGNORED_ARGS}
        if engine_args.pop("task", "generate") not in ("generate", "auto", "embed"):
            raise ValueError("task: conveyor generates ('generate') and pools embeddings "
                             "('embed', LLM.embed) only")
        known = set(EngineArgs.field_names())
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters ``generate`` uses when given none: the model's generation_config.json
        defaults (``generation_config="auto"``), else SamplingParams()'s (vLLM's name)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. All prompts are validated before any runs."""
        prompt_list: list[PromptType]
        if isinstance(prompts, str | dict):
            prompt_list = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompt_list = [list(prompts)]  # type: ignore[arg-type]  # one prompt of token ids
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        prompts = prompt_list
        # Only final outputs are returned: the engine need not build any before (as vLLM)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [p.replace(output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _per_prompt(sampling_params, len(prompts))]
        encoded = [self.engine.tokenize_prompt(p) for p in prompts]  # raises on bad input
        ids = []
        try:
            for (text, token_ids), p in zip(encoded, params, strict=True):
                prompt: PromptType = text if text is not None else token_ids
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request: None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered by the model's chat template
        (``continue_final_message``: continue the last message, a reply's start, instead;
        with ``add_generation_prompt=False``, as vLLM asks). vLLM's keywords: ``tools`` and
        ``chat_template_kwargs`` go to the template; text content parts are joined."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        conversations: list[list[dict[str, Any]]] = (
            messages if messages and isinstance(messages[0], list)  # type: ignore[assignment]
            else [messages])  # type: ignore[list-item]
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        # the template kwargs may set the two flags, and win (as in vLLM)
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        kwargs.pop("tokenize", None)  # (the ids are what this needs)
        prompts: list[PromptType] = []
        for conversation in conversations:
            prompts.append({"prompt_token_ids": tokenizer.encode_chat(
                [_text_parts_joined(m) for m in conversation], add_generation_prompt,
                continue_final_message, **kwargs)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = False,
              pooling_params: None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): the final hidden state of the
        prompt's last token, L2-normalized (last-token pooling, as Qwen3-Embedding's and
        e5-mistral's; a chat model's are not made for retrieval). Give the prompt as the
        model's card says (an instruction; the tokenizer adds its EOS where it does)."""
        if pooling_params is not None:
            raise ValueError("pooling_params: only the default pooling (last token, "
                             "normalized) is supported")
        outputs = self.generate(prompts, EMBEDDING_PARAMS, use_tqdm)
        for o in outputs:
            if o.embedding is None:
                raise RuntimeError(f"request {o.request_id} ended without its embedding: "
                                   f"{o.outputs[0].error if o.outputs else 'it failed'}")
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding or []),
                                       o.prompt_token_ids) for o in outputs]

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("encode: conveyor pools embeddings only (LLM.embed)")

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        self.engine.shutdown()

    def stats(self) -> EngineStats:
        """KV blocks total/free, preemptions, running and waiting requests, and more."""
        return self.engine.stats()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="requests", unit="req")
        wanted = set(request_ids)
        try:
            while wanted - final.keys():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        final[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            self.engine.abort_request(list(wanted - final.keys()))
            raise
        finally:
            if progress is not None:
                progress.close()
            # This thread's OpenMP workers go with the call: the next call may come from
            # another thread, and two pools on a small CPU slow every kernel (ops/openmp.py)
            release_openmp_threads()
        return [final[i] for i in request_ids]


def _text_parts_joined(message: Any) -> Any:
    """A message whose content is OpenAI's parts, with its text parts joined (newlines, as the
    server joins them): templates expect a string. Other parts are a ValueError."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or \
                not isinstance(part.get("text"), str):
            raise ValueError("messages: only text content parts ({'type': 'text', 'text': "
                             f"...}}) are supported, got {part!r:.60}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params

