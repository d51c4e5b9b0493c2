"""A fake model for engine tests: its next token is a function of the whole context, read back from its own
paged KV cache through slot_mapping and block_tables, so any batching or block-accounting mistake changes the text."""
from types import SimpleNamespace

import numpy as np
import torch

from nanograph.backends.base import PendingTokens, Runner
from nanograph.config import Config
from nanograph.sampling import Sampler
from nanograph.engine.llm_engine import LLMEngine

VOCAB_SIZE = 50
EOS = 0


def next_token(context) -> int:
    context = np.asarray(context, dtype=np.int64)
    return int((context * np.arange(1, len(context) + 1)).sum() % (VOCAB_SIZE - 1)) + 1  # never EOS


def reference_completion(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner(Runner):
    device = torch.device("cpu")
    kv_cache_dtype = torch.int64  # kv_tokens' and kv_positions' elements

    def __init__(self, num_kv_blocks: int, block_size: int, peak: float = 10.0, eos_token_ids=(EOS,), seed: int = 0):
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.peak = peak  # the next token's logit, the others' being -peak: 10 is as good as greedy, 1 is random
        self.kv_tokens = np.full(num_kv_blocks * block_size, -1)
        self.kv_positions = np.full(num_kv_blocks * block_size, -1)
        self.batches = []
        self.sampled = None
        self.sampler = Sampler(self.device, eos_token_ids, seed)
        self.logits = None

    def forward(self, batch, seqs):
        self.logits = self.run(batch)

    def sample(self, rows, seqs) -> PendingTokens:
        pending = self.sampler.sample(self.logits[rows], seqs)
        self.sampled = pending.token_ids.numpy().copy()
        return PendingTokens(pending, range(len(rows)))

    def run(self, batch) -> torch.Tensor:
        self.batches.append(batch)
        pending = batch.input_src >= 0
        input_ids = np.where(pending, self.sampled[np.maximum(batch.input_src, 0)] if pending.any() else 0,
                             batch.input_ids)
        self.kv_tokens[batch.slot_mapping] = input_ids
        self.kv_positions[batch.slot_mapping] = batch.positions
        logits = torch.full((batch.num_seqs, VOCAB_SIZE), -self.peak)
        for i, context_len in enumerate(batch.context_lens):
            positions = np.arange(context_len)
            slots = batch.block_tables[i, positions // self.block_size] * self.block_size + positions % self.block_size
            assert (self.kv_positions[slots] == positions).all(), "the KV cache lost or misplaced a token"
            logits[i, next_token(self.kv_tokens[slots])] = self.peak
        return logits


class FakeTokenizer:
    """Token t reads " t", so that, as with a real tokenizer, the text of a sequence is the text of its tokens."""

    def __init__(self, eos_token_id: int = EOS):
        self.eos_token_id = eos_token_id  # the end-of-text token, as a real tokenizer names one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # it has no special tokens to add
        return [ord(c) % (VOCAB_SIZE - 1) + 1 for c in text]

    def decode(self, token_ids, skip_special_tokens=False, spaces_between_special_tokens=True) -> str:
        return "".join(f" {t}" for t in token_ids if not (skip_special_tokens and t == EOS))


def fake_engine(num_kv_blocks: int = 64, block_size: int = 4, eos_token_ids=(EOS,), max_model_len: int = 64,
                peak: float = 10.0, **config) -> LLMEngine:
    model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_ids=list(eos_token_ids),
                                   max_context=max(max_model_len, 256))
    runner = FakeRunner(num_kv_blocks, block_size, peak, eos_token_ids, config.get("seed", 0))
    return LLMEngine(Config(max_model_len=max_model_len, **config), model_config, runner,
                     FakeTokenizer(eos_token_ids[0]))
