"""nanograph: a small, fast LLM inference engine with a C++/CUDA core."""
from ._core import CORE_ERROR, core_available, gpu_available
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM
from .outputs import CompletionDelta, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["CORE_ERROR", "core_available", "gpu_available", "__version__",
           "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "CompletionDelta", "Logprob",
           "RequestMetrics", "RequestOutputKind", "TextPrompt", "TokensPrompt"]
