"""nanograph: a small, fast LLM inference engine with a C++/CUDA core."""
from ._core import CORE_ERROR, core_available, gpu_available
from .async_engine import AsyncLLM, AsyncLLMEngine, EngineDeadError
from .beam_search import BeamSearchOutput, BeamSearchSequence
from .engine.llm_engine import EngineSleeping, LLMEngine
from .engine_args import AsyncEngineArgs, EngineArgs
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM
from .outputs import CompletionDelta, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                      PoolerConfig, PoolingOutput, PoolingParams, PoolingRequestOutput, ScoringOutput,
                      ScoringRequestOutput)
from .sampling_params import (BeamSearchParams, GuidedDecodingParams, RequestOutputKind, SamplingParams,
                              StructuredOutputsParams)

__version__ = "0.1.0"

__all__ = ["CORE_ERROR", "core_available", "gpu_available", "__version__",
           "LLM", "LLMEngine", "AsyncLLMEngine", "AsyncLLM", "EngineArgs", "AsyncEngineArgs", "EngineDeadError",
           "EngineSleeping", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "RequestOutputKind", "RequestOutput", "CompletionOutput", "CompletionDelta", "Logprob", "RequestMetrics",
           "BeamSearchOutput", "BeamSearchSequence", "TextPrompt", "TokensPrompt", "PoolingParams", "PoolerConfig",
           "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "ClassificationOutput", "ClassificationRequestOutput"]
