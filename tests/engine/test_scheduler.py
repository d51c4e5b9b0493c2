import pytest

from nanograph import SamplingParams
from nanograph.config import Config
from nanograph.engine.batch import build_forward_batch
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from nanograph.engine.stop_checker import StopChecker

from .fake_model import EOS, fake_engine, reference_completion

BLOCK_SIZE = 4


def make_scheduler(num_blocks=64, **config) -> Scheduler:
    return Scheduler(Config(**config), BlockManager(num_blocks, BLOCK_SIZE))


def add_requests(scheduler, count, prompt_len, max_tokens=16) -> list[Sequence]:
    seqs = [Sequence(str(i), None, [100 * i + j for j in range(1, prompt_len + 1)],
                     SamplingParams(max_tokens=max_tokens))
            for i in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def step(scheduler):
    """One step whose sampled tokens (7) are known at once."""
    batch = scheduler.schedule()
    finish_step(scheduler, batch)
    return batch


def finish_step(scheduler, batch):
    scheduler.advance(batch)
    sampled = [seq for seq, samples in zip(batch.seqs, batch.samples) if samples]
    for seq in sampled:
        seq.token_ids.append(PENDING_TOKEN)
    for seq in sampled:  # the engine's part: each pending token becomes a 7, and the stop checker rules
        seq.token_ids[-1] = 7
        if StopChecker({EOS}).check(seq):
            scheduler.finish(seq)


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(256, 128), (9, 8)])
def test_a_token_budget_below_max_num_seqs_is_refused(max_num_seqs, max_num_batched_tokens):
    """vLLM's rule: a step of max_num_seqs decoding sequences takes a token of each, so the budget holds them all
    (it used to cap the running set at the budget in silence)."""
    with pytest.raises(ValueError, match=rf"max_num_batched_tokens \({max_num_batched_tokens}\) must be at least "
                                         rf"max_num_seqs \({max_num_seqs}\).*raise max_num_batched_tokens or lower "
                                         rf"max_num_seqs"):
        Config(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    Config(max_num_seqs=max_num_batched_tokens, max_num_batched_tokens=max_num_batched_tokens)  # equal is fine


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=1000)
    seqs = add_requests(scheduler, 5, prompt_len=10)
    batch = step(scheduler)
    assert batch.is_prefill and batch.seqs == seqs[:3]
    batch = step(scheduler)
    assert not batch.is_prefill and batch.seqs == seqs[:3] and batch.num_new_tokens == [1, 1, 1]


def test_finished_sequences_make_room_for_waiting_ones():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    seqs = add_requests(scheduler, 3, prompt_len=5, max_tokens=1)
    assert step(scheduler).seqs == seqs[:2]
    assert all(seq.is_finished for seq in seqs[:2])
    assert step(scheduler).seqs == seqs[2:]
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 64


def test_a_step_mixes_decodes_with_prompt_chunks_under_the_token_budget():
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=25)
    seqs = add_requests(scheduler, 4, prompt_len=10)
    batch = step(scheduler)
    assert batch.seqs == seqs[:3] and batch.num_new_tokens == [10, 10, 5] and batch.samples == [True, True, False]
    batch = step(scheduler)  # decodes first, then the cut prompt continues, then admission resumes
    assert batch.is_prefill and batch.seqs == seqs and batch.num_new_tokens == [1, 1, 5, 10]
    assert batch.samples == [True] * 4
    batch = step(scheduler)
    assert not batch.is_prefill and batch.seqs == seqs and batch.num_new_tokens == [1, 1, 1, 1]


def test_a_long_prompt_is_prefilled_in_chunks_beside_a_decoding_sequence():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    short, long = add_requests(scheduler, 1, prompt_len=5)[0], add_requests(scheduler, 1, prompt_len=40)[0]
    for num_new, long_start in [([5, 11], 0), ([1, 15], 11), ([1, 14], 26), ([1, 1], 40)]:
        batch = scheduler.schedule()
        assert batch.seqs == [short, long] and batch.num_new_tokens == num_new
        forward = build_forward_batch(batch, scheduler.block_manager)
        long_positions = list(range(long_start, long_start + num_new[1]))
        assert forward.positions.tolist()[num_new[0]:] == long_positions
        assert forward.input_ids.tolist()[num_new[0]:] == long.token_ids[long_start:long_start + num_new[1]]
        finish_step(scheduler, batch)
    assert short.num_completion_tokens == 4 and long.num_completion_tokens == 2


def test_prompt_longer_than_the_budget_is_prefilled_in_pieces():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    [seq] = add_requests(scheduler, 1, prompt_len=40)
    for start, num_new in [(0, 16), (16, 16), (32, 8)]:
        assert seq.num_completion_tokens == 0
        batch = scheduler.schedule()
        forward = build_forward_batch(batch, scheduler.block_manager)
        assert forward.positions.tolist() == list(range(start, start + num_new))
        assert forward.input_ids.tolist() == seq.token_ids[start:start + num_new]
        assert forward.context_lens.tolist() == [start + num_new]
        finish_step(scheduler, batch)
    assert seq.num_completion_tokens == 1 and seq.num_computed_tokens == 40


def test_preemption_frees_the_latest_sequence_and_keeps_its_tokens():
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = add_requests(scheduler, 3, prompt_len=7, max_tokens=8)
    step(scheduler)  # 2 blocks each: the pool is full
    step(scheduler)  # position 7 still fits everyone's second block
    batch = step(scheduler)  # position 8 needs a third block
    assert batch.seqs == seqs[:2]
    victim = seqs[2]
    assert list(scheduler.waiting) == [victim] and victim.status is SequenceStatus.WAITING
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    assert victim.token_ids == list(range(201, 208)) + [7, 7] and victim.num_prompt_tokens == 7

    while scheduler.has_unfinished():
        step(scheduler)
    assert all(seq.num_completion_tokens == 8 and seq.finish_reason == "length" for seq in seqs)
    assert scheduler.block_manager.num_free_blocks == 6


def test_preempted_requests_finish_with_the_unconstrained_output():
    prompts = [[(7 * i + j) % 40 + 1 for j in range(7)] for i in range(4)]
    engine = fake_engine(num_kv_blocks=6, block_size=4, max_model_len=24, max_num_seqs=64,
                         max_num_batched_tokens=64)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=10)] * 4, use_tqdm=False)
    assert preempted
    assert [out.outputs[0].token_ids for out in outputs] == [reference_completion(p, 10) for p in prompts]


def test_the_prefix_cache_counts_each_prompt_once_when_it_is_admitted():
    """vLLM's prefix_cache_queries and _hits: a request that waits several steps for room, or is preempted and
    comes back, counts its prompt (and the tokens it found cached) once."""
    engine = fake_engine(num_kv_blocks=16, block_size=4, max_model_len=64)
    blocks = engine.scheduler.block_manager
    engine.generate([[7] * 20], [SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)  # caches 4 blocks of 7s
    queried, hits = blocks.num_prefix_queried_tokens, blocks.num_prefix_hit_tokens
    engine.add_request([1] * 40, SamplingParams(temperature=0, max_tokens=20))  # holds 15 of the 16 blocks at its end
    engine.add_request([7] * 20 + [3] * 20, SamplingParams(temperature=0, max_tokens=1))  # waits for room
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps > 3  # the second request waited
    # One of the 7s' cached blocks outlived the long request.
    assert (blocks.num_prefix_queried_tokens - queried, blocks.num_prefix_hit_tokens - hits) == (80, 4)

    engine = fake_engine(num_kv_blocks=10, block_size=4, max_model_len=40)
    blocks = engine.scheduler.block_manager
    engine.generate([[i + 1] * 12 for i in range(4)], [SamplingParams(temperature=0, max_tokens=25)] * 4,
                    use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert (blocks.num_prefix_queried_tokens, blocks.num_prefix_hit_tokens) == (48, 0)  # no two share a block


def prioritized(scheduler, priorities, prompt_len=4, max_tokens=16) -> list[Sequence]:
    """Requests arriving in list order, with these priorities."""
    seqs = [Sequence(str(i), None, [100 * i + j for j in range(1, prompt_len + 1)],
                     SamplingParams(max_tokens=max_tokens)) for i in range(len(priorities))]
    for i, (seq, priority) in enumerate(zip(seqs, priorities)):
        seq.priority, seq.arrival_time, seq.queue_order = priority, 1000.0 + i, i
        scheduler.add(seq)
    return seqs


@pytest.mark.parametrize("policy, expected", [("fcfs", ["0", "1", "2", "3"]), ("priority", ["1", "3", "2", "0"])])
def test_the_priority_policy_admits_lower_priorities_first_then_earlier_arrivals(policy, expected):
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy=policy)
    seqs = prioritized(scheduler, [5, -1, 3, -1], max_tokens=2)
    admitted = []
    while scheduler.has_unfinished():
        batch = step(scheduler)
        admitted += [seq.request_id for seq in batch.seqs if seq.request_id not in admitted]
    assert admitted == expected
    assert all(seq.is_finished for seq in seqs)


@pytest.mark.parametrize("policy, victim", [("fcfs", "2"), ("priority", "1")])
def test_the_priority_policy_preempts_the_largest_priority_value(policy, victim):
    """Three one-block prompts fill 3 of 5 blocks; their next tokens need a block each: one is preempted. fcfs
    takes the latest admitted, the priority policy the one of the largest priority value; it comes back first
    among the waiting (of equal or larger values) and recomputes its tokens."""
    scheduler = make_scheduler(num_blocks=5, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy=policy)
    seqs = prioritized(scheduler, [0, 2, 1], prompt_len=BLOCK_SIZE)
    assert sorted(seq.request_id for seq in step(scheduler).seqs) == ["0", "1", "2"]
    batch = step(scheduler)
    assert scheduler.num_preemptions == 1
    assert sorted(seq.request_id for seq in batch.seqs) == sorted({"0", "1", "2"} - {victim})
    assert [seq.request_id for seq in scheduler.waiting] == [victim]
    later = prioritized(scheduler, [3])[0]  # arrives after: behind the preempted one (priority 1 or 2 < 3)
    later.request_id = "late"
    assert [seq.request_id for seq in scheduler.waiting] == [victim, "late"]
    assert seqs[int(victim)].num_computed_tokens == 0 and seqs[int(victim)].num_tokens == BLOCK_SIZE + 1


def test_a_prompt_chunk_leaves_a_token_for_each_sequence_stepped_after_it():
    """Under the priority policy a prompt cut short by the budget may come before decoding sequences (a lower
    priority value): its chunk leaves each of them its token. The batch's rows put the decodes first (the CUDA core's
    decode attention takes a step's leading one-token rows)."""
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, scheduling_policy="priority")
    decoding = prioritized(scheduler, [5, 5], prompt_len=2)
    step(scheduler)  # both prompts computed: they decode from here
    long = prioritized(scheduler, [0], prompt_len=40)[0]
    long.queue_order = 9
    batch = step(scheduler)  # admitted into the 6 tokens the decodes left
    assert batch.seqs[2] is long and batch.num_new_tokens == [1, 1, 6]
    batch = step(scheduler)  # now stepped first, by its priority: 6 tokens, then a token for each decode
    assert batch.seqs == [*decoding, long] and batch.num_new_tokens == [1, 1, 6]
    assert batch.samples == [True, True, False]
    assert batch.num_tokens == 8 and all(n > 0 for n in batch.num_new_tokens)
    assert build_forward_batch(batch, scheduler.block_manager).cu_seqlens_q.tolist() == [0, 1, 2, 8]


def test_under_the_priority_policy_steps_with_decodes_first_end_as_the_reference():
    """Requests arrive while others decode, the later ones with lower priority values: their prompts' chunks are
    scheduled before the decodes and laid out after them. Every request ends with its reference output."""
    engine = fake_engine(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=8,
                         scheduling_policy="priority")
    prompts = [[(5 * i + j) % 40 + 1 for j in range(3 + 4 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12)
    laid_out = []
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        laid_out.append(list(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = recorded
    ids = [engine.add_request({"prompt_token_ids": prompts[0]}, params, priority=5)]
    outputs = {}
    for step_index in range(200):
        if step_index % 3 == 1 and len(ids) < len(prompts):
            ids.append(engine.add_request({"prompt_token_ids": prompts[len(ids)]}, params, priority=5 - len(ids)))
        outputs.update((out.request_id, out) for out in engine.step())
        if len(outputs) == len(prompts):
            break
    assert [outputs[i].outputs[0].token_ids for i in ids] == [reference_completion(p, 12) for p in prompts]
    mixed = [rows for rows in laid_out if any(n > 1 for n in rows) and 1 in rows]
    assert mixed and all(rows == sorted(rows, key=lambda n: n > 1) for rows in laid_out)


def test_under_the_priority_policy_an_aborted_waiting_request_leaves_the_queue_at_once():
    """Requests of lower priority values keep arriving: an ended waiting request of a larger value would never reach
    the queue's front, where the queue drops ended ones."""
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority")
    running, *waiting = prioritized(scheduler, [0, 5, 5, 7], max_tokens=100)
    step(scheduler)
    for seq in waiting[:2]:
        scheduler.finish(seq)
    assert list(scheduler.waiting) == [waiting[2]] and scheduler.num_waiting == 1
    scheduler.finish(waiting[2])
    assert not scheduler.waiting and scheduler.num_waiting == 0 and running in scheduler.running
