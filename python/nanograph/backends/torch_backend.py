"""TorchRunner: the plain-PyTorch reference backend (CPU, or a GPU for comparisons), over a paged KV cache.

Each layer mirrors transformers' rounding in the model dtype (RMSNorm in float32, cast back, then scaled), so
float32 logits match HF closely. Attention runs as one padded batch: queries [seqs, max_new, heads, head_dim]
against keys gathered from the cache by block table, with a mask that is causal from the cached-prefix offset.
With kv_cache_dtype "fp8" the cache holds e4m3 with a K and a V scale per layer (models/kv_cache.py): keys and
values are quantized on the way in and dequantized to the model dtype on the way out.

Under tensor parallelism (backends/tensor_parallel.py) a TorchRunner holds one rank's shard (models/sharding.py)
and all_reduce sums the partial outputs of the embedding, o_proj and down_proj over the ranks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..model_config import ModelConfig
from ..models import head_logits, load_weights, rms_norm, rope_cos_sin
from ..models.kv_cache import dequantize_kv, kv_bytes_per_token, kv_cache_torch_dtype, load_kv_scales, quantize_kv
from ..models.sharding import Shard
from ..sampling import Sampler
from .base import PendingTokens, Runner, copy_weights

KV_CACHE_BUDGET_BYTES = 1 << 30


class TorchRunner(Runner):
    more_kv_cache = (f"raise num_kv_blocks (the torch backend sizes its cache by max_num_seqs x max_model_len, up to "
                     f"{KV_CACHE_BUDGET_BYTES >> 30} GiB, not by gpu_memory_utilization)")

    def __init__(self, model_config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 1, seed: int = 0,
                 quantization: str | None = None, kv_cache_dtype: str = "auto", shard: Shard | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        self.model_config = mc = model_config
        self.device = torch.device(device)
        self.block_size = block_size
        max_model_len = max_model_len or mc.max_position_embeddings
        self.shard, self.all_reduce = shard, all_reduce
        self.num_heads = len(shard.q_heads(mc)) if shard else mc.num_heads  # this rank's
        self.num_kv_heads = len(shard.kv_heads(mc)) if shard else mc.num_kv_heads
        # FP8 linears (the checkpoint's, or quantization="fp8") run dequantized: their values, in dtype's matmuls.
        self._load_weights = lambda device=None: load_weights(mc.path, mc, dtype, device or self.device, shard,
                                                              quantization=quantization, dequantize=True)
        self.weights = self._load_weights()
        cos_sin = rope_cos_sin(mc, max_model_len, self.device)
        half = mc.head_dim // 2
        # [max_model_len, head_dim] in the model dtype, each half repeated, as HF's rotary embedding returns them
        self.cos = cos_sin[:, :half].repeat(1, 2).to(dtype)
        self.sin = cos_sin[:, half:].repeat(1, 2).to(dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        # FP8: each layer's [K scale, V scale]; None: the cache holds keys and values as they are
        self.kv_scales = None if kv_cache_dtype == "auto" else load_kv_scales(mc.path, mc).tolist()
        kv_heads = shard.most_kv_heads(mc) if shard else mc.num_kv_heads
        bytes_per_token = kv_bytes_per_token(mc, kv_heads, self.kv_cache_dtype)
        # Within the budget; the engine caps a default max_model_len at what it holds (a given one that does not fit
        # is an error there).
        kv_tokens = max(min(max_num_seqs * max_model_len, KV_CACHE_BUDGET_BYTES // bytes_per_token), block_size)
        self.num_kv_blocks = num_kv_blocks or -(-kv_tokens // block_size)
        self._allocate_kv_cache()
        self.sampler = Sampler(self.device, mc.eos_token_ids, seed)
        self._logits: torch.Tensor | None = None  # the last forward's
        self._hidden: torch.Tensor | None = None  # the last forward's final hidden states, every token
        self._sampled: torch.Tensor | None = None  # the last sampled tokens, where input_src points

    def _allocate_kv_cache(self):
        # k_caches[i], v_caches[i]: [num_kv_blocks, block_size, num_kv_heads, head_dim]
        shape = (self.num_kv_blocks, self.block_size, self.num_kv_heads, self.model_config.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                         for _ in range(self.model_config.num_layers)]
        self.v_caches = [torch.zeros_like(cache) for cache in self.k_caches]

    supports_sleep = True

    def sleep(self, tags: set[str], keep_weights: bool):
        """Weights kept on the CPU stay where they are (host memory already); on a GPU they are copied to host
        memory first."""
        weights = "weights" in tags
        if weights and keep_weights and self.weights is not None and self.device.type != "cpu" and \
                self._host_weights is None:
            self._host_weights = copy_weights(self.weights, torch.device("cpu"))
        self._logits = self._hidden = self._sampled = None
        if "kv_cache" in tags:
            self.k_caches = self.v_caches = None
        if weights and not (keep_weights and self.device.type == "cpu"):
            self._free_weights()
        if weights and not keep_weights:
            self._host_weights = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: set[str]):
        if "weights" in tags and self.weights is None:
            self._restore_weights()
        if "kv_cache" in tags and self.k_caches is None:
            self._allocate_kv_cache()

    def reload_weights(self):
        self._reload_into(self.weights)

    def forward(self, batch, seqs: list):
        self._logits = self.run(batch)

    def sample(self, rows: list[int], seqs: list) -> PendingTokens:
        logits = self._logits if len(rows) == len(self._logits) else self._logits[rows]
        pending = self.sampler.sample(logits, seqs)
        self._sampled = pending.token_ids.to(self.device, torch.long)
        return PendingTokens(pending, range(len(rows)))

    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        """float32 logits [num_seqs, vocab] for each sequence's last new token."""
        last_token_rows = torch.from_numpy(batch.cu_seqlens_q[1:] - 1).to(self.device, torch.long)
        return head_logits(self.run_layers(batch)[last_token_rows], self.weights, self.model_config.rms_norm_eps)

    @torch.inference_mode()
    def run_layers(self, batch) -> torch.Tensor:
        """The final hidden states [num_tokens, hidden_size] (the final norm's input): the step without the head,
        which is all that a tensor-parallel rank other than 0 runs."""
        mc, w = self.model_config, self.weights
        meta = _AttentionMetadata.build(batch, self.block_size, self.device)
        positions = torch.from_numpy(batch.positions).to(self.device, torch.long)
        cos, sin = self.cos[positions, None, :], self.sin[positions, None, :]
        h = self._embed(self.input_ids(batch))
        for i in range(mc.num_layers):
            p = f"layers.{i}."
            h = h + self._attention(i, rms_norm(h, w[p + "input_layernorm"], mc.rms_norm_eps), cos, sin, meta)
            h = h + self._mlp(i, rms_norm(h, w[p + "post_attention_layernorm"], mc.rms_norm_eps))
        self._hidden = h
        return h

    def final_hidden(self) -> torch.Tensor:
        return self._hidden

    def input_ids(self, batch) -> torch.Tensor:
        """The step's input ids, those the host has not read yet taken from the last sampled tokens."""
        input_ids = torch.from_numpy(batch.input_ids).to(self.device, torch.long)
        pending = batch.input_src >= 0
        if pending.any():
            rows = torch.from_numpy(pending).to(self.device)
            input_ids[rows] = self._sampled[torch.from_numpy(batch.input_src[pending]).to(self.device, torch.long)]
        return input_ids

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' rows of the table; an id outside the vocabulary gets a zero row, as the core's embedding gives
        it: a row whose every token was masked samples one, and its request fails once the host reads it, while
        the step that already read it on the device goes on for the other rows."""
        table = self.weights["embed_tokens"]
        if self.shard is None:
            inside = (input_ids >= 0) & (input_ids < len(table))
            return torch.where(inside[:, None], table[input_ids.clamp(0, len(table) - 1)], 0)
        vocab = self.shard.vocab(self.model_config)
        local = input_ids - vocab.start
        inside = (local >= 0) & (local < len(vocab))
        return self._reduce(torch.where(inside[:, None], table[local.clamp(0, len(vocab) - 1)], 0))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial (itself on one rank)."""
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial

    def _attention(self, layer: int, x, cos, sin, meta: _AttentionMetadata) -> torch.Tensor:
        mc, w, p = self.model_config, self.weights, f"layers.{layer}."
        nq, nkv, hd = self.num_heads, self.num_kv_heads, mc.head_dim
        qkv = F.linear(x, w[p + "qkv_proj"], w.get(p + "qkv_bias"))
        q, k, v = (t.view(len(x), -1, hd) for t in qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1))
        if mc.qk_norm:
            q, k = rms_norm(q, w[p + "q_norm"], mc.rms_norm_eps), rms_norm(k, w[p + "k_norm"], mc.rms_norm_eps)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        k_cache, v_cache = self.k_caches[layer].view(-1, nkv, hd), self.v_caches[layer].view(-1, nkv, hd)
        stored = slice(None) if meta.stored_tokens is None else meta.stored_tokens
        k_cache[meta.slot_mapping] = self._stored(k[stored], layer, 0)
        v_cache[meta.slot_mapping] = self._stored(v[stored], layer, 1)
        queries = q.new_zeros(meta.num_seqs, meta.max_query_len, nq, hd)
        queries[meta.query_seq, meta.query_offset] = q
        group = nq // nkv  # repeated by hand: sdpa's enable_gqa needs torch >= 2.5
        keys, values = (self._read(cache[meta.kv_slots], layer, kv, q.dtype).repeat_interleave(group, dim=2)
                        .transpose(1, 2) for kv, cache in enumerate((k_cache, v_cache)))
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=meta.mask)
        out = out.transpose(1, 2)[meta.query_seq, meta.query_offset]
        return self._reduce(F.linear(out.reshape(len(x), nq * hd), w[p + "o_proj"]))

    def _stored(self, x: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        """Keys (kv 0) or values (kv 1) of a layer as its cache holds them."""
        return x if self.kv_scales is None else quantize_kv(x, self.kv_scales[layer][kv])

    def _read(self, cached: torch.Tensor, layer: int, kv: int, dtype: torch.dtype) -> torch.Tensor:
        """Keys (kv 0) or values (kv 1) gathered from a layer's cache, in dtype."""
        return cached if self.kv_scales is None else dequantize_kv(cached, self.kv_scales[layer][kv], dtype)

    def _mlp(self, layer: int, x) -> torch.Tensor:
        w, p = self.weights, f"layers.{layer}."
        gate, up = F.linear(x, w[p + "gate_up_proj"]).chunk(2, dim=-1)
        return self._reduce(F.linear(F.silu(gate) * up, w[p + "down_proj"]))


@dataclass
class _AttentionMetadata:
    """Index tensors shared by every layer of one step."""
    num_seqs: int
    max_query_len: int
    slot_mapping: torch.Tensor    # [stored tokens]: where each stored token's K/V goes in the flattened cache
    stored_tokens: torch.Tensor | None  # the tokens whose slot is not -1 (None: all of them)
    query_seq: torch.Tensor       # [num_tokens]: the sequence of each new token
    query_offset: torch.Tensor    # [num_tokens]: its index among that sequence's new tokens
    kv_slots: torch.Tensor        # [num_seqs, max_context_len]: cache slot of each position (padding reads slot 0)
    mask: torch.Tensor            # bool [num_seqs, 1, max_query_len, max_context_len]: True where attention is allowed

    @classmethod
    def build(cls, batch, block_size: int, device: torch.device) -> _AttentionMetadata:
        cu = batch.cu_seqlens_q.astype(np.int64)
        query_lens = np.diff(cu)
        context_lens = batch.context_lens.astype(np.int64)
        num_seqs, max_query_len = len(query_lens), int(query_lens.max())
        key_pos = np.arange(int(context_lens.max()))
        kv_slots = batch.block_tables[:, key_pos // block_size].astype(np.int64) * block_size + key_pos % block_size
        # query i of a sequence sits at position context_len - query_len + i and sees keys up to it
        query_pos = (context_lens - query_lens)[:, None] + np.arange(max_query_len)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        query_seq = np.repeat(np.arange(num_seqs), query_lens)

        def tensor(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        slots = batch.slot_mapping.astype(np.int64)
        stored = np.flatnonzero(slots >= 0)  # slot -1 stores nothing (a negative index would name the last slot)
        return cls(num_seqs, max_query_len,
                   slot_mapping=tensor(slots[stored]),
                   stored_tokens=None if len(stored) == len(slots) else tensor(stored),
                   query_seq=tensor(query_seq),
                   query_offset=tensor(np.arange(cu[-1]) - cu[query_seq]),
                   kv_slots=tensor(kv_slots), mask=tensor(mask[:, None]))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
