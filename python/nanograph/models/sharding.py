"""Shard: which part of each weight one tensor-parallel rank holds (Megatron's split, as vLLM makes it, except that
head and row counts the ranks do not divide are split unevenly).

qkv and gate|up are split by output rows (column-parallel): each rank its share of the KV heads with the query
heads that read them (whole GQA groups, so SmolLM2's 3 KV heads go 1 and 2 over 2 ranks; with fewer KV heads than
ranks, each rank holds the one KV head its query heads share, replicated as vLLM does), and its share of the MLP's
intermediate rows. o_proj and down_proj are split by input columns to match (row-parallel: each rank's product is
a partial sum, all-reduced). The embedding is split by vocabulary rows (each rank looks up the tokens in its range,
zeros elsewhere, all-reduced). Norms are replicated. The head (final norm, lm_head) runs on rank 0 alone, which
holds the whole lm_head."""
from __future__ import annotations

from dataclasses import dataclass

from ..model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    @staticmethod
    def check(mc: ModelConfig, world: int):
        """ValueError unless every rank can hold whole heads."""
        nq, nkv = mc.num_heads, mc.num_kv_heads
        if nkv < world and (world % nkv or nq % world):
            raise ValueError(f"tensor_parallel_size ({world}) is more than num_key_value_heads ({nkv}), so each rank "
                             f"holds a copy of one KV head: that needs num_key_value_heads to divide "
                             f"tensor_parallel_size and tensor_parallel_size to divide num_attention_heads ({nq}); "
                             f"use a tensor_parallel_size of at most {nkv} or one that does")

    def kv_heads(self, mc: ModelConfig) -> range:
        nkv = mc.num_kv_heads
        if nkv >= self.world:
            return range(self.rank * nkv // self.world, (self.rank + 1) * nkv // self.world)
        first = self.rank * nkv // self.world
        return range(first, first + 1)

    def q_heads(self, mc: ModelConfig) -> range:
        group = mc.num_heads // mc.num_kv_heads
        if mc.num_kv_heads >= self.world:
            kv = self.kv_heads(mc)
            return range(kv.start * group, kv.stop * group)
        per_rank = mc.num_heads // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def most_kv_heads(self, mc: ModelConfig) -> int:
        """The most KV heads any rank holds: every rank sizes its KV cache by it, so that all have as many blocks."""
        return max(len(Shard(rank, self.world).kv_heads(mc)) for rank in range(self.world))

    def intermediate(self, mc: ModelConfig) -> range:
        size = mc.intermediate_size
        return range(self.rank * size // self.world, (self.rank + 1) * size // self.world)

    def vocab(self, mc: ModelConfig) -> range:
        """The rank's embedding rows: ceil(vocab / world) each, the last rank's fewer."""
        per_rank = -(-mc.vocab_size // self.world)
        return range(min(self.rank * per_rank, mc.vocab_size), min((self.rank + 1) * per_rank, mc.vocab_size))
