"""conveyor: an LLM inference server with continuous batching over a paged KV cache."""

from conveyor.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> object:
    # `LLM` pulls in torch; import it lazily so `conveyor.core` and the CLI stay light.
    if name == "LLM":
        from conveyor.engine.llm import LLM

        return LLM
    raise AttributeError(name)
