"""Engines for AsyncLLM's engine process, built there by name (module-level functions, so that the process can
import them): the fake model, and the same with a fault planted."""
from __future__ import annotations

import time

from ..engine.fake_model import fake_engine

FAILING_SEED = 666  # a request with this seed fails in sampling
DYING_SEED = 13  # once a request with this seed has a token, the step loop itself fails
FAILING_ADD_SEED = 777  # adding a request with this seed raises a RuntimeError
SLOW_SEED = 31  # a batch holding a request with this seed samples SLOW_STEP_SECONDS late
SLOW_STEP_SECONDS = 0.05  # a request of tens of tokens then runs for seconds, not milliseconds


def fake(peak: float = 1.0):
    return fake_engine(peak=peak)


def failing_sampler():
    """Sampling raises for any batch holding a FAILING_SEED request: that request fails, the others go on; adding a
    FAILING_ADD_SEED request raises something other than a ValueError; a batch holding a SLOW_SEED request samples
    slowly."""
    engine = fake_engine(peak=1.0)
    sample = engine.runner.sample

    def failing_sample(rows, seqs):
        if any(seq.params.seed == FAILING_SEED for seq in seqs):
            raise RuntimeError("injected sampling failure")
        if any(seq.params.seed == SLOW_SEED for seq in seqs):
            time.sleep(SLOW_STEP_SECONDS)
        return sample(rows, seqs)

    engine.runner.sample = failing_sample
    add_request = engine.add_request

    def failing_add(prompt, params, *args, **kwargs):
        if params.seed == FAILING_ADD_SEED:
            raise RuntimeError("injected failure while adding")
        return add_request(prompt, params, *args, **kwargs)

    engine.add_request = failing_add
    return engine


def dying_loop():
    """A defect outside any request: step() raises once a DYING_SEED request has a token."""
    engine = fake_engine()
    step = engine.step

    def dying_step():
        if any(seq.params.seed == DYING_SEED and seq.num_completion_tokens
               for request in engine.requests.values() for seq in request.seqs):
            return 1 / 0
        return step()

    engine.step = dying_step
    return engine


def unbuildable():
    raise ValueError("max_model_len 70000 is more than the KV cache holds")
