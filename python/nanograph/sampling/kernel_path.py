"""The kernel path: on a GPU with the core, one kernel (csrc/sample_rows.cu) samples every row from its parameters
and a 64-bit key drawn on the host (from the request's own stream when it has a seed); rows with penalties or masked
tokens are first copied out and modified. The host packs every parameter into one pinned buffer sent in one copy,
launches both kernels through one binding (ops.sample_packed), and reads the token ids and logprobs back from one
results buffer in one copy (packed_layout.py, staging.py). A plain-greedy batch takes the core's argmax alone."""
from __future__ import annotations

import numpy as np
import torch

from .kernel_plan import KernelBatchRows, KernelPlan
from .outputs import CopiedSample, LogprobRows, PendingSample, SamplerOutput, sampler_output
from .packed_layout import PackedFormat, PackedLayout
from .seen import SeenTokens
from .staging import HeldResults, Staging, StagingSlot
from .table import SampledSequence
from .torch_path import with_logprobs


class KernelPath:
    def __init__(self, device: torch.device, eos_token_ids: list[int], seed: int, core):
        """core: nanograph._C, whose kernels sample and which declares the packed blobs."""
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self._core = core
        self._format = PackedFormat.of(core)
        self._keys = np.random.Generator(np.random.PCG64(seed))  # the rows' keys, but seeded rows'
        self._seen = SeenTokens()
        self._staging = Staging(pin=device.type == "cuda")
        self._batch: KernelBatchRows | None = None  # the last call's, reused while the batch stays the same

    def plain_greedy(self, seqs: list[SampledSequence], vocab_size: int) -> bool:
        self._batch = KernelBatchRows.of(seqs, vocab_size, self._batch)
        return self._batch.plain_greedy

    def sample(self, logits: torch.Tensor, seqs: list[SampledSequence]) -> PendingSample:
        plan = self.plan(logits, seqs)
        if plan.plain_greedy:
            return self._argmax(logits)
        pending = self.launch(logits, plan, *self.upload(plan, logits.device))
        b = plan.batch
        if plan.kernel_logprobs or not b.logprob_rows:
            return pending
        logprob_rows = torch.tensor(b.logprob_rows, device=self.device)  # more top ones than the kernel gives
        return with_logprobs(logits, LogprobRows(b.logprob_rows, b.num_top_logprobs), pending.token_ids, logprob_rows)

    def _argmax(self, logits: torch.Tensor) -> CopiedSample:
        """The argmax of every row, without parameters to send: the core's on bfloat16 logits (int32 ids)."""
        if logits.dtype != torch.bfloat16:
            return CopiedSample(logits.argmax(dim=-1))
        token_ids = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
        self._core.argmax(logits, token_ids)
        return CopiedSample(token_ids)

    # The stages of a call, which benchmarks/bench_sampler.py --host times apart: plan, upload, launch.

    def plan(self, logits: torch.Tensor, seqs: list[SampledSequence]) -> KernelPlan:
        plan = KernelPlan(seqs, logits.shape[-1], self.eos_token_ids, self._seen, self._keys, self._format,
                          self._batch)
        self._batch = plan.batch
        return plan

    def upload(self, plan: KernelPlan, device: torch.device) -> tuple[StagingSlot, torch.Tensor]:
        """The plan's parameters packed into a staging slot and copied to the device (queued): the slot, and the
        parameters blob on the device."""
        layout = plan.layout
        slot = self._staging.slot_for(layout)
        layout.pack(plan.arrays, slot.params_view)
        return slot, slot.params[:layout.params_nbytes].to(device, non_blocking=True)

    def launch(self, logits: torch.Tensor, plan: KernelPlan, slot: StagingSlot, params: torch.Tensor) -> PackedSample:
        """Queues the kernels on the uploaded parameters, then the copy of their results to slot."""
        layout = plan.layout
        results = torch.empty(layout.results_nbytes, dtype=torch.uint8, device=logits.device)
        num_overrides = layout.counts["num_overrides"]
        overrides = torch.empty(num_overrides, logits.shape[-1], device=logits.device) if num_overrides else None
        self._core.sample_packed(logits, params, layout.layout, results, overrides)
        b = plan.batch
        logprobs = LogprobRows(b.logprob_rows, b.num_top_logprobs) if plan.kernel_logprobs else None
        return PackedSample(results, layout, slot.hold(results), logprobs)


class PackedSample(PendingSample):
    """The kernel path's: the results blob of ops.sample_packed (layout.results) on the device, where the next step
    reads the token ids, and its copy on the host (HeldResults), read with result()."""

    def __init__(self, results: torch.Tensor, layout: PackedLayout, held: HeldResults, logprobs: LogprobRows | None):
        token_ids = layout.results["token_ids"]
        self.token_ids = results[token_ids.offset:token_ids.offset + token_ids.nbytes].view(torch.int64)
        self._layout, self._held, self._logprobs = layout, held, logprobs

    def _read(self) -> SamplerOutput:
        blob, fields = self._held.take(), self._layout.results
        token_ids = fields["token_ids"].of(blob).tolist()
        if self._logprobs is None:
            return sampler_output(token_ids)
        rows = self._logprobs.rows
        return sampler_output(token_ids, self._logprobs, fields["logprobs"].of(blob)[rows],
                              fields["logprob_ids"].of(blob)[rows])
