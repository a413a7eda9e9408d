"""Offline inference with vLLM's names: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.stats import EngineStats
from conveyor.ops.openmp import release_openmp_threads
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """A model behind the continuous-batching engine, driven to completion per call.

    Every engine argument is a keyword: ``LLM(model=..., max_num_seqs=..., block_size=...,
    kv_cache_memory=..., max_model_len=..., dtype=..., load_format=...)``.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        known = set(EngineArgs.field_names())
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

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
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to conversations rendered by the model's chat template
        (``continue_final_message``: continue the last message, a reply's start, instead;
        with ``add_generation_prompt=False``, as vLLM asks)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations: list[list[dict[str, Any]]] = (
            messages if messages and isinstance(messages[0], list)  # type: ignore[assignment]
            else [messages])  # type: ignore[list-item]
        prompts: list[PromptType] = []
        for conversation in conversations:
            prompts.append({"prompt_token_ids":
                            tokenizer.encode_chat(conversation, add_generation_prompt,
                                                  continue_final_message)})
        return self.generate(prompts, sampling_params, use_tqdm)

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

