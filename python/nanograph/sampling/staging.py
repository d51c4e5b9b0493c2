"""The kernel path's host buffers, reused from call to call in two slots used in turn: a call packs its parameters
into a slot's pinned buffer for one copy to the device, and its results come back in one copy to the slot's other
buffer, where the host reads them later (the engine reads a step's tokens after it has queued the next step's
sampling).

The invariant: a call's results (HeldResults) read as that call's whenever they are taken, even after their slot
has been reused. The slot records an event after queueing the copy of a call's results into it; reusing the slot
(reclaim) waits for that event (by then the device has read the slot's parameters too) and gives results not taken
yet a copy of their own before either buffer is written again. The engine takes each step's results before their
slot comes round again (it reads step N's tokens before it queues step N+2's sampling), so it never pays that
copy."""
from __future__ import annotations

import numpy as np
import torch

from .outputs import recorded_event
from .packed_layout import PackedLayout


class HeldResults:
    """One call's results blob, in its slot's host buffer until the slot is reused, then in a copy of its own."""

    def __init__(self, blob: np.ndarray, copied: torch.cuda.Event | None):
        self._blob: np.ndarray | None = blob  # uint8; None once taken
        self._copied = copied  # recorded after the copy into blob was queued (None: the copy was synchronous)

    def take(self) -> np.ndarray:
        """The blob, once the device's copy into it is done. Taken once: the caller reads what it needs at once, as
        the blob may be the slot's buffer, which a later call reuses."""
        if self._blob is None:
            raise RuntimeError("these results were taken already")
        if self._copied is not None:
            self._copied.synchronize()
        blob, self._blob = self._blob, None
        return blob

    def keep(self):
        """Called by the slot before it is reused, once the copy is done: an untaken blob moves to a copy."""
        if self._blob is not None:
            self._blob = self._blob.copy()
        self._copied = None


class StagingSlot:
    """One call's host buffers, uint8 and pinned on a GPU: the parameters packed for the device (params, and
    params_view, a numpy view of it) and the results copied back (results)."""

    def __init__(self, pin: bool):
        self._pin = pin
        self.params = self.results = torch.empty(0, dtype=torch.uint8)
        self.params_view = self._results_view = self.params.numpy()  # numpy views of them
        self._copied: torch.cuda.Event | None = None  # recorded after the last call's results copy was queued
        self._held: HeldResults | None = None  # that call's results

    def reclaim(self, layout: PackedLayout):
        """Makes the slot ready for a call of layout: waits until the device is done with its last call (its copies
        from and to the slot come before the event), keeps that call's results if they are not taken yet, then
        grows the buffers if they must."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._held is not None:
            self._held.keep()
        self._copied = self._held = None
        if len(self.params) < layout.params_nbytes:
            self.params = self._grown(self.params, layout.params_nbytes)
            self.params_view = self.params.numpy()
        if len(self.results) < layout.results_nbytes:
            self.results = self._grown(self.results, layout.results_nbytes)
            self._results_view = self.results.numpy()

    def hold(self, results: torch.Tensor) -> HeldResults:
        """Queues the copy of a call's results blob (uint8 on the device) into the slot, and records the event after
        it; the results as the host will read them."""
        nbytes = len(results)
        self.results[:nbytes].copy_(results, non_blocking=True)
        self._copied = recorded_event(results.device)
        self._held = HeldResults(self._results_view[:nbytes], self._copied)
        return self._held

    def _grown(self, buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
        """A new buffer for at least nbytes, at least twice buffer's size: a batch that grows step by step does not
        allocate each step."""
        return torch.empty(max(nbytes, 2 * len(buffer), 4096), dtype=torch.uint8, pin_memory=self._pin)


class Staging:
    """A path's two staging slots, used in turn: a call packs its parameters while the previous call's results may
    still be on their way."""

    def __init__(self, pin: bool):
        self._slots = (StagingSlot(pin), StagingSlot(pin))
        self._turn = 0

    def slot_for(self, layout: PackedLayout) -> StagingSlot:
        slot = self._slots[self._turn]
        self._turn ^= 1
        slot.reclaim(layout)
        return slot
