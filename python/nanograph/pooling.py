"""Embeddings: a causal LM run as a pooling model (vLLM's runner="pooling"), its prompt's final hidden states (after
the final norm) pooled into one vector per prompt.

The pooler's settings come from the model folder's sentence-transformers files where it has them (modules.json
naming a Pooling module, whose config.json says the pooling mode, and a Normalize module), else last-token pooling,
normalized, as vLLM converts a causal LM; pooler_config overrides either. A request's PoolingParams may ask for fewer
dimensions (a Matryoshka model's leading ones) and whether to normalize."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .config import POOLING_TYPES, PoolerConfig
from .hub import sentence_transformers_modules
from .model_config import CLASSIFIER_SUFFIX
from .models.weights import load_classifier
from .sampling_params import check_truncate_prompt_tokens, truncation_length

TASK_NOUNS = {"embed": "an embedding model", "classify": "a classifier"}
# sentence-transformers' Pooling config keys, and the pooling type each selects.
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True, eq=False)
class Pooler:
    """How an engine pools: the settings of the model folder and pooler_config together. task "embed" returns the
    pooled vector (an embedding); "classify" (a sequence classifier's folder) its class probabilities: the
    classifier's logits over the last token's hidden state, through a softmax (a sigmoid for one label)."""
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    hidden_size: int
    # A Matryoshka model's dimensions that a request may ask for (None: any up to hidden_size; empty: none but all).
    matryoshka_dimensions: tuple[int, ...] | None
    task: str = "embed"  # or "classify"
    classifier: torch.Tensor | None = None  # classify: float32 [num_labels, hidden_size], on the runner's device
    labels: tuple[str, ...] = ()  # classify: each class's name (config.json's id2label)
    activation: str = "softmax"  # classify: "softmax" over the classes, "sigmoid" of each, or "identity"
    score_activation: str = "sigmoid"  # a cross-encoder's score of its logit: "sigmoid" or "identity"

    @classmethod
    def for_model(cls, model_config, given=None, device="cpu", task: str | None = None) -> Pooler:
        """model_config: a ModelConfig (its folder and config.json); given: Config.pooler_config; device: where the
        runner's hidden states are (a classifier's head is put there); task: Config.pooling_task, the folder's
        (None) or one it must have."""
        override = PoolerConfig.of(given)
        hf = model_config.hf_config
        folder_task = "classify" if is_classifier(hf) else "embed"
        if task not in (None, folder_task):
            architectures = getattr(hf, "architectures", None)
            raise ValueError(f"task={task!r} (or convert) asks for {TASK_NOUNS[task]}, and {model_config.path} "
                             f"holds {TASK_NOUNS[folder_task]} (architectures {architectures}); "
                             + ("use a sequence classifier's folder (architectures *ForSequenceClassification, "
                                "with its `score` head): nanograph adds no head to a model" if task == "classify"
                                else "leave task out and call classify()"))
        if folder_task == "classify":
            if override.normalize is not None:
                raise ValueError("pooler_config.normalize is for embeddings, and this model is a classifier; leave "
                                 "it out")
            classifier = load_classifier(model_config.path, model_config).to(device)
            num_labels = classifier.shape[0]
            names = getattr(hf, "id2label", None) or {}
            labels = tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
            # transformers' classifiers score the last token (the last that is not padding).
            return cls(override.pooling_type or "LAST", False, model_config.hidden_size, (), "classify",
                       classifier, labels, _classifier_activation(hf, num_labels), _score_activation(hf))
        pooling_type, normalize = _sentence_transformers_pooling(Path(model_config.path),
                                                                 needs_type=override.pooling_type is None)
        pooling_type = override.pooling_type or pooling_type or "LAST"
        normalize = override.normalize if override.normalize is not None else normalize if normalize is not None \
            else True
        dims = getattr(hf, "matryoshka_dimensions", None)
        if dims:
            matryoshka = tuple(int(d) for d in dims)
        else:
            matryoshka = None if getattr(hf, "is_matryoshka", False) else ()
        return cls(pooling_type, normalize, model_config.hidden_size, matryoshka)

    @property
    def num_labels(self) -> int:
        return 0 if self.classifier is None else self.classifier.shape[0]

    def check(self, params: PoolingParams):
        """ValueError naming the field when the engine cannot serve params."""
        if self.task == "classify":
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise ValueError(f"{name} is for embeddings, and this model is a classifier, whose output is one "
                                     f"probability per class; leave {name} unset (use_activation=False gives the "
                                     f"logits)")
            return
        if params.use_activation is not None:
            raise ValueError("use_activation is for a classifier's probabilities, and this model gives embeddings; "
                             "use normalize=False for an embedding that is not normalized")
        if params.dimensions is None:
            return
        if self.matryoshka_dimensions == ():
            raise ValueError("dimensions: this model is not a Matryoshka model, whose leading dimensions form an "
                             "embedding of their own; leave dimensions unset (or, for one that is, set "
                             "hf_overrides={\"is_matryoshka\": true})")
        if not 1 <= params.dimensions <= self.hidden_size:
            raise ValueError(f"dimensions={params.dimensions} is outside [1, {self.hidden_size}] (the model's "
                             f"hidden size)")
        if self.matryoshka_dimensions and params.dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions={params.dimensions} is not one the model was trained for; use one of "
                             f"{list(self.matryoshka_dimensions)}")

    def finish(self, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """What the requests get of pooled ([prompts, hidden_size] float32, all with params). Embeddings: cut to
        params.dimensions, then normalized as params (else the pooler) says. Classes: the classifier's
        probabilities (its logits with use_activation=False)."""
        if self.task == "classify":
            logits = pooled @ self.classifier.T
            return logits if params.use_activation is False else activated(logits, self.activation)
        if params.dimensions is not None:
            pooled = pooled[:, :params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def activated(logits, activation: str):
    """A classifier's logits (a tensor, or a numpy array) through its activation."""
    logits = torch.as_tensor(logits)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1) if activation == "softmax" else logits


def _classifier_activation(hf, num_labels: int) -> str:
    """What turns a classifier's logits into its probabilities, by transformers' problem_type: none for a
    regression, a sigmoid for one label or several independent ones, a softmax over the classes otherwise."""
    problem_type = getattr(hf, "problem_type", None)
    if problem_type == "regression":
        return "identity"
    return "sigmoid" if num_labels == 1 or problem_type == "multi_label_classification" else "softmax"


def _score_activation(hf) -> str:
    """What turns a cross-encoder's logit into its score: the activation a sentence-transformers CrossEncoder saved
    in config.json (activation_fn, or the older sbert_ce_default_activation_function), Identity or Sigmoid; else a
    sigmoid."""
    saved = getattr(hf, "sentence_transformers", None)
    name = (saved.get("activation_fn") if isinstance(saved, dict) else None) or \
        getattr(hf, "sbert_ce_default_activation_function", None)
    short = str(name).rsplit(".", 1)[-1] if name else "Sigmoid"
    if short not in ("Identity", "Sigmoid"):
        raise ValueError(f"config.json's cross-encoder activation {name!r} is not one nanograph applies to a score; "
                         f"it applies torch.nn.Identity or torch.nn.Sigmoid (set the folder's "
                         f"sentence_transformers.activation_fn to one of them)")
    return short.lower()


def is_classifier(hf_config) -> bool:
    """Whether a model folder's config.json names a sequence classifier (Qwen3ForSequenceClassification, ...)."""
    return any(str(name).endswith(CLASSIFIER_SUFFIX) for name in getattr(hf_config, "architectures", None) or [])


def _sentence_transformers_pooling(folder: Path, needs_type: bool = True) -> tuple[str | None, bool | None]:
    """The pooling type and normalization the folder's sentence-transformers modules give (None: not said). Where
    the type is needed (no override), a pooling mode nanograph does not have (max, weighted mean, ...) is a
    ValueError naming the override."""
    modules = sentence_transformers_modules(folder)
    if not modules:
        return None, None
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling") and module.get("path"):
            try:
                config = json.loads((folder / module["path"] / "config.json").read_text())
            except (OSError, ValueError):
                continue
            modes = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value)
            if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
                if not needs_type:
                    continue
                raise ValueError(f"{folder / module['path'] / 'config.json'} pools by {' and '.join(modes) or 'none'}"
                                 f" of the modes, and nanograph pools by one of "
                                 f"{', '.join(_SENTENCE_TRANSFORMERS_MODES)}; pass pooler_config="
                                 f"{{\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\"}} to choose one")
            pooling_type = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
    return pooling_type, normalize


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for embed() and encode()."""
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    dimensions: int | None = None  # a Matryoshka model's leading dimensions to keep (None: all)
    normalize: bool | None = None  # None: as the model's pooler does
    use_activation: bool | None = None  # a classifier's: False gives its logits, not probabilities (None: True)

    def __post_init__(self):
        if self.truncate_prompt_tokens is not None:
            check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or
                                            not isinstance(self.dimensions, (int, np.integer)) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")

    def clone(self) -> PoolingParams:
        return replace(self)


class PoolingState:
    """One prompt's pooling as its chunks are computed, float32 on the runner's device: the sum of its rows (MEAN),
    its first row (CLS) or its last (LAST), over the prompt's first `count` tokens; data, once the prompt is
    done: the embedding on the host."""

    def __init__(self, params: PoolingParams, pooling_type: str):
        self.params = params
        self.pooling_type = pooling_type
        self.pooled: torch.Tensor | None = None
        self.count = 0
        self.data: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, first: int):
        """rows: the final-normed hidden states of prompt tokens first .. first + len(rows) - 1, float32; MEAN takes
        them in order, from token `count` on."""
        if self.pooling_type == "MEAN":
            total = rows.sum(dim=0)
            self.pooled = total if self.pooled is None else self.pooled + total
        elif self.pooling_type == "CLS":
            self.pooled = rows[0]
        else:
            self.pooled = rows[-1]
        self.count = first + len(rows)

    def result(self) -> torch.Tensor:
        return self.pooled / self.count if self.pooling_type == "MEAN" else self.pooled

    def rows_to_pool(self, start: int, num_new: int, completes: bool) -> range:
        """Of the prompt tokens start .. start + num_new - 1 that a step computes (completes: the prompt's last
        among them), those to pool: MEAN all not pooled yet (a preempted prompt computes again those it has), CLS
        the first token, LAST the last."""
        end = start + num_new
        if self.pooling_type == "MEAN":
            return range(max(start, self.count), end)
        if self.pooling_type == "CLS":
            return range(0, 1) if start == 0 and self.pooled is None else range(0)
        return range(end - 1, end) if completes else range(0)


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (float32, on the CPU)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None  # None for a request that a failure (error) or an abort ended
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens taken from the prefix cache
    metrics: object | None = None  # RequestMetrics
    error: str | None = None  # set when a failure inside a step ended the request


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(_data(output).tolist()), output.prompt_token_ids,
                   output.finished, output.prompt)


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per class (the logits, with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(output.request_id, ClassificationOutput(_data(output).tolist()), output.prompt_token_ids,
                   output.finished, output.prompt)


def _data(output: PoolingRequestOutput) -> torch.Tensor:
    if output.outputs is None:
        raise RuntimeError(f"request {output.request_id} ended without its result: {output.error or 'it was aborted'}")
    return output.outputs.data


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two texts' tokens, the first's then the second's
    finished: bool = True


def score_pairs(first: list, second: list) -> list[tuple]:
    """vLLM's pairing of score()'s two sides: one against each of many, or as many against as many (in order)."""
    if not first or not second:
        raise ValueError("score() needs at least one text on each side")
    if len(first) == 1:
        return [(first[0], other) for other in second]
    if len(first) != len(second):
        raise ValueError(f"score() pairs one text with many, or as many with as many: got {len(first)} and "
                         f"{len(second)}; pass one first text, or as many as second texts")
    return list(zip(first, second))


def cosine(a, b) -> float:
    """The cosine similarity of two vectors (numpy arrays or tensors), as vLLM scores with an embedding model."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-8))


def cosine_scores(pairs: list[tuple[PoolingRequestOutput, PoolingRequestOutput]]) -> list[ScoringRequestOutput]:
    """Each pair's score: the cosine similarity of its pooled vectors."""
    return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(cosine(a.outputs.data,
                                                                                        b.outputs.data)),
                                 a.prompt_token_ids + b.prompt_token_ids) for a, b in pairs]


def pair_token_ids(tokenizer, first, second, add_special_tokens: bool = True,
                   max_length: int | None = None) -> list[int]:
    """A cross-encoder's input for a pair: two texts (str, or {"prompt": str}) as the tokenizer encodes a pair of
    them (its separator, and its special tokens if add_special_tokens), or two token-id prompts one after the other
    as given; at most max_length tokens (the tokenizer cuts the longer text first; joined ids keep their first
    max_length, the first side's before the second's)."""
    texts = [prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) and
             "prompt_token_ids" not in prompt else None for prompt in (first, second)]
    if None not in texts:
        if tokenizer is None:
            raise ValueError("scoring texts needs the model folder's tokenizer, and there is none "
                             "(skip_tokenizer_init=True): give token ids")
        cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        return list(tokenizer(texts[0], text_pair=texts[1], add_special_tokens=add_special_tokens,
                              **cut)["input_ids"])
    ids = [prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt for prompt in (first, second)]
    if any(isinstance(one, str) or one is None for one in ids):
        raise ValueError("a cross-encoder reads each pair together: give both sides as texts, or both as token ids")
    return ([int(token) for token in ids[0]] + [int(token) for token in ids[1]])[:max_length]


def classifier_scores(outputs: list[PoolingRequestOutput], activation: str) -> list[ScoringRequestOutput]:
    """Each pair's score from a cross-encoder (a classifier of one label, run on the pair's tokens together): its
    logit (outputs with use_activation=False) through the score's activation."""
    return [ScoringRequestOutput(output.request_id, ScoringOutput(float(activated(_data(output), activation)[0])),
                                 output.prompt_token_ids) for output in outputs]


def pair_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The most tokens of a cross-encoder's pair (pair_token_ids' max_length) that truncate_prompt_tokens asks."""
    if truncate_prompt_tokens is None:
        return None
    check_truncate_prompt_tokens(truncate_prompt_tokens)
    return truncation_length(truncate_prompt_tokens, max_model_len)


__all__ = ["PoolerConfig", "Pooler", "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "POOLING_TYPES"]
