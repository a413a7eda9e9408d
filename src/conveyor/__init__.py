"""conveyor: an LLM inference server with continuous batching over a paged KV cache."""

from conveyor.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt",
           "__version__"]


def __getattr__(name: str) -> object:
    # `LLM` pulls in torch; import it (and the rest of vLLM's top-level names) lazily so that
    # `conveyor.core` and the CLI stay light.
    if name == "LLM":
        from conveyor.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from conveyor import outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from conveyor.config import EngineArgs

        return EngineArgs
    if name in ("TextPrompt", "TokensPrompt"):
        from conveyor import prompts

        return getattr(prompts, name)
    raise AttributeError(name)
