"""Host-only scheduler and cache-pool bookkeeping: admission, reservation, chunking, decode positions,
the `auto` budget, aborts, and a property test that drives the scheduler the way the engine does."""

from __future__ import annotations

import collections
import random
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen35_jax.serving.plan import (
    DecodeRow,
    PrefillChunk,
    Request,
    RequestStatus,
    StateCopy,
    StepPlan,
    bucket_for,
    packed_chunk_buckets,
    packed_unified_chunk_buckets,
    power_of_two_buckets,
)
from qwen35_jax.serving.pools import TRASH_PAGE, PagePool, SlotPool, pages_needed
from qwen35_jax.serving.scheduler import OverlapBudget, RequestRejected, Scheduler, SchedulerConfig, trace


def make_config(**overrides) -> SchedulerConfig:
    fields = dict(max_batch=4, page_size=4, num_pages=65, num_slots=5, max_model_len=256)
    return SchedulerConfig(**(fields | overrides))


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    # Distinct token values per position so that chunk contents can be checked against the prompt.
    return Request(request_id, list(range(1000, 1000 + prompt_len)), max_tokens)


def scheduler_with(*requests: Request, **overrides) -> Scheduler:
    scheduler = Scheduler(make_config(**overrides))
    for request in requests:
        scheduler.add(request)
    return scheduler


def assert_pools_full(scheduler: Scheduler) -> None:
    assert scheduler.page_pool.num_free == scheduler.page_pool.num_total
    assert scheduler.slot_pool.num_free == scheduler.slot_pool.num_total
    assert scheduler.page_usage() == 0.0 and scheduler.slot_usage() == 0.0


# ---- pools ----------------------------------------------------------------------------------------


def test_pages_needed_rounds_up():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_page_pool_never_hands_out_the_trash_page():
    pool = PagePool(num_pages=6, page_size=16)
    assert pool.num_total == 5
    pages = pool.allocate(5)
    assert sorted(pages) == [1, 2, 3, 4, 5] and TRASH_PAGE not in pages
    assert not pool.can_allocate(1) and pool.num_free == 0
    pool.free(pages)
    assert pool.num_free == 5 and pool.can_allocate(5) and not pool.can_allocate(6)


def test_page_pool_refuses_double_free_and_the_trash_page():
    pool = PagePool(num_pages=4, page_size=16)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(AssertionError, match="twice"):
        pool.free(pages[:1])
    with pytest.raises(AssertionError):
        pool.free([TRASH_PAGE])
    with pytest.raises(AssertionError):
        pool.allocate(3)  # only 2 free


def test_slot_pool_keeps_the_last_slot_as_trash():
    pool = SlotPool(num_slots=3)
    assert pool.trash_slot == 2 and pool.num_total == 2
    slots = [pool.allocate(), pool.allocate()]
    assert sorted(slots) == [0, 1] and not pool.can_allocate()
    with pytest.raises(AssertionError):
        pool.free(pool.trash_slot)
    pool.free(slots[0])
    with pytest.raises(AssertionError, match="twice"):
        pool.free(slots[0])
    assert pool.allocate() == slots[0]


# ---- config and rejection -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(max_batch=0), "max_batch"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
        (dict(page_size=0), "page_size"),
        (dict(num_pages=1), "num_pages"),
        (dict(num_slots=1), "num_slots"),
        (dict(max_batch=4, num_slots=4), "num_slots"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(policy="adaptive"), "policy"),
        (dict(decode_overlap="green"), "decode_overlap"),
        (dict(max_prefill_chunks=0), "max_prefill_chunks"),
        (dict(finishing_window=-1), "finishing_window"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        make_config(**overrides)


def test_rejects_a_request_longer_than_the_model_length():
    scheduler = scheduler_with(max_model_len=100)
    with pytest.raises(RequestRejected, match=r"\(90 tokens\).*\(11\).*101 tokens.*100 tokens"):
        scheduler.add(make_request("a", 90, 11))
    scheduler.check_request(90, 10)  # exactly the model length fits


def test_rejects_a_request_larger_than_the_whole_kv_pool():
    # 64 allocatable pages of 4 tokens = 256 tokens; 200 + 60 = 260 tokens need 65 pages.
    scheduler = scheduler_with(num_pages=65, max_model_len=1000)
    with pytest.raises(RequestRejected, match=r"needs 65 KV pages.*holds 64"):
        scheduler.add(make_request("a", 200, 60))
    assert scheduler.num_waiting == 0 and not scheduler.has_work()
    scheduler.check_request(200, 56)  # 256 tokens: exactly the whole pool


def test_rejects_empty_prompts_negative_max_tokens_and_prompt_logprobs_when_off():
    scheduler = scheduler_with()
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.add(make_request("a", 0, 4))
    with pytest.raises(RequestRejected, match="max_tokens must be at least 0, got -1"):
        scheduler.add(make_request("b", 4, -1))
    with pytest.raises(RequestRejected, match="prompt logprobs are off"):
        scheduler.add(Request("c", [1, 2, 3], 4, prompt_logprobs=True))
    assert issubclass(RequestRejected, ValueError) and scheduler.num_waiting == 0


def test_rejects_a_duplicate_request_id():
    scheduler = scheduler_with(make_request("a", 4, 4))
    with pytest.raises(RequestRejected, match="'a'"):
        scheduler.add(make_request("a", 4, 4))
    assert scheduler.num_waiting == 1


# ---- admission ------------------------------------------------------------------------------------


def test_admission_reserves_all_pages_up_front():
    request = make_request("a", 10, 7)  # 17 tokens -> 5 pages of 4
    scheduler = scheduler_with(request)
    scheduler.schedule()
    assert len(request.page_ids) == 5 and request.slot is not None
    assert scheduler.page_pool.num_free == 64 - 5 and request.status is RequestStatus.DECODING


def test_admission_is_fcfs_with_head_of_line_blocking():
    # 16 allocatable pages: "big" (10 pages) fits, "blocked" (10 pages) does not, and "small" (1 page)
    # would, but must not overtake the front of the queue.
    big, blocked, small = (
        make_request("big", 30, 10),
        make_request("blocked", 30, 10),
        make_request("small", 2, 2),
    )
    scheduler = scheduler_with(big, blocked, small, num_pages=17)
    plan = scheduler.schedule()
    assert [chunk.request_id for chunk in plan.prefill] == ["big"]
    assert list(scheduler.running) == ["big"] and scheduler.num_waiting == 2
    assert blocked.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING


def test_a_waiting_request_is_admitted_when_another_finishes():
    first, second = make_request("first", 30, 10), make_request("second", 30, 10)
    scheduler = scheduler_with(first, second, num_pages=17)
    for _ in range(3):
        scheduler.schedule()
        assert second.status is RequestStatus.WAITING  # still short of pages
    assert scheduler.finish("first", "stop") and first.status is RequestStatus.FINISHED
    assert first.slot is None and first.page_ids == ()
    plan = scheduler.schedule()
    assert [chunk.request_id for chunk in plan.prefill] == ["second"]
    assert second.status is RequestStatus.DECODING and len(second.page_ids) == 10


def test_max_batch_bounds_running_requests_and_decode_rows():
    requests = [make_request(f"r{i}", 3, 20) for i in range(6)]
    scheduler = scheduler_with(*requests, max_batch=2, num_slots=8)
    for _ in range(10):
        plan = scheduler.schedule()
        assert scheduler.num_running == 2 and plan.num_decode_rows <= 2
    assert scheduler.num_waiting == 4 and scheduler.slot_pool.num_free == 5
    scheduler.finish("r0", "stop")
    scheduler.schedule()
    assert list(scheduler.running) == ["r1", "r2"]


# ---- prefill chunks and decode rows ---------------------------------------------------------------


def test_chunks_cover_the_prompt_once_in_order():
    request = make_request("a", 50, 4)
    scheduler = scheduler_with(request, max_prefill_tokens=16)
    chunks = [chunk for _ in range(4) for chunk in scheduler.schedule().prefill]
    assert [(c.start, len(c.token_ids), c.is_last) for c in chunks] == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
    ]
    assert [t for c in chunks for t in c.token_ids] == request.prompt_ids
    assert request.num_computed_tokens == 50 and request.num_output_tokens == 1


def test_several_prompts_share_one_step_budget():
    # Three chunks pad to a row bucket of 3 (max_prefill_chunks) and chunk buckets of at least 64 tokens: 3 x 64
    # fits the 256-token programs, 3 x 128 would not, so the third chunk is cut at 64 tokens although the budget
    # has 246 left.
    a, b, c = make_request("a", 5, 2), make_request("b", 5, 2), make_request("c", 100, 2)
    scheduler = scheduler_with(a, b, c, max_prefill_tokens=256, max_prefill_chunks=3)
    plan = scheduler.schedule()
    assert [(ch.request_id, ch.start, len(ch.token_ids), ch.is_last) for ch in plan.prefill] == [
        ("a", 0, 5, True),
        ("b", 0, 5, True),
        ("c", 0, 64, False),
    ]
    assert plan.num_prefill_tokens == 74 and plan.action == "prefill"


def test_a_packed_step_never_pads_past_one_full_chunk():
    # A first chunk of 200 tokens (bucket 256) leaves no room for a second: 2 x 256 padded tokens exceed 256.
    long, short = make_request("long", 200, 2), make_request("short", 5, 2)
    scheduler = scheduler_with(long, short, max_prefill_tokens=256, max_prefill_chunks=4)
    assert [c.request_id for c in scheduler.schedule().prefill] == ["long"]
    # With the long prompt decoding, the short one prefills beside it.
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.prefill] == ["short"] and len(plan.decode) == 1


def test_prompts_that_arrive_while_others_decode_prefill_together():
    # Beside decode rows, chunks of up to 256 / 4 = 64 tokens: the three short prompts go in one step with the
    # first 64 tokens of the 100-token one, which finishes in the next beside the last prompt.
    decoder = make_request("d", 3, 8)
    scheduler = scheduler_with(decoder, max_prefill_tokens=256, max_prefill_chunks=4, max_batch=8, num_slots=9)
    scheduler.schedule()
    for i, length in enumerate((4, 60, 9, 100, 7)):
        scheduler.add(make_request(f"p{i}", length, 2))
    plans = [scheduler.schedule() for _ in range(3)]
    assert [[(c.request_id, len(c.token_ids)) for c in plan.prefill] for plan in plans] == [
        [("p0", 4), ("p1", 60), ("p2", 9), ("p3", 64)],
        [("p3", 36), ("p4", 7)],
        [],
    ]
    assert all(len(plan.decode) >= 1 for plan in plans)


def test_a_long_front_chunk_runs_alone_beside_decode_rows():
    decoder = make_request("d", 3, 8)
    scheduler = scheduler_with(decoder, max_prefill_tokens=256, max_prefill_chunks=4)
    scheduler.schedule()
    scheduler.add(make_request("long", 200, 2))
    scheduler.add(make_request("short", 4, 2))
    plans = [scheduler.schedule() for _ in range(2)]
    assert [[(c.request_id, len(c.token_ids)) for c in plan.prefill] for plan in plans] == [[("long", 200)],
                                                                                            [("short", 4)]]  # fmt: skip


def test_under_stream_overlap_a_step_with_decode_rows_carries_one_chunk():
    decoder = make_request("d", 3, 8)
    scheduler = scheduler_with(decoder, max_prefill_tokens=256, max_prefill_chunks=4, decode_overlap="stream")
    scheduler.schedule()
    for i in range(3):
        scheduler.add(make_request(f"p{i}", 4, 2))
    plans = [scheduler.schedule() for _ in range(3)]
    assert [[c.request_id for c in plan.prefill] for plan in plans] == [["p0"], ["p1"], ["p2"]]
    assert all(len(plan.decode) >= 1 for plan in plans)


def test_max_prefill_chunks_limits_requests_per_step():
    scheduler = scheduler_with(*(make_request(f"r{i}", 2, 2) for i in range(3)), max_prefill_chunks=2)
    assert [c.request_id for c in scheduler.schedule().prefill] == ["r0", "r1"]


def test_decode_positions_follow_the_sequence_across_steps():
    request = make_request("a", 5, 4)
    scheduler = scheduler_with(request)
    first = scheduler.schedule()
    assert first.action == "prefill" and first.prefill[0].is_last and first.decode == ()
    rows = [scheduler.schedule().decode for _ in range(3)]
    assert [row.position for (row,) in rows] == [5, 6, 7]
    assert all(row.slot == request.slot and row.page_ids == request.page_ids for (row,) in rows)
    assert request.num_output_tokens == 4 and request.remaining_tokens == 0
    # Length limit reached at launch time: no more rows, but the slot is kept until `finish`.
    assert scheduler.schedule().action == "idle"
    assert scheduler.num_running == 1 and scheduler.slot_pool.num_free == scheduler.slot_pool.num_total - 1
    scheduler.finish("a", "length")
    assert_pools_full(scheduler)


def test_a_prompt_completed_in_this_step_decodes_from_the_next_step():
    a, b = make_request("a", 3, 8), make_request("b", 3, 8)
    scheduler = scheduler_with(a, max_prefill_tokens=16)
    scheduler.schedule()
    scheduler.add(b)
    plan = scheduler.schedule()
    assert plan.action == "unified"
    assert [row.request_id for row in plan.decode] == ["a"] and plan.prefill[0].request_id == "b"
    plan = scheduler.schedule()
    assert [(row.request_id, row.position) for row in plan.decode] == [("a", 4), ("b", 3)]


def test_max_tokens_one_is_done_after_the_last_chunk():
    request = make_request("a", 6, 1)
    scheduler = scheduler_with(request)
    assert scheduler.schedule().prefill[0].is_last and request.remaining_tokens == 0
    assert scheduler.schedule().action == "idle"


def test_a_request_that_waits_for_its_tokens_decodes_only_after_each_is_read():
    """A grammar request's next row waits until the host has read its last token; the other request keeps a row
    in every step, as it would alone."""
    g = Request("g", list(range(1000, 1003)), 8, waits_for_tokens=True)
    u = make_request("u", 3, 8)
    scheduler = scheduler_with(g, u, max_prefill_tokens=128, max_prefill_chunks=2)
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.prefill] == ["g", "u"] and g.awaits_token  # the first token is in flight
    rows = []
    for step in range(6):
        rows.append([row.request_id for row in scheduler.schedule().decode])
        if step % 2 == 0:  # the engine reads a step's tokens one step late
            scheduler.token_read("g")
    assert rows == [["u"], ["g", "u"], ["u"], ["g", "u"], ["u"], ["g", "u"]]
    assert g.num_read_tokens == 3 and g.num_output_tokens == 4 and u.num_output_tokens == 7


def test_a_request_that_waits_for_its_tokens_and_decodes_alone_gets_idle_steps_between_rows():
    g = Request("g", [7, 8], 3, waits_for_tokens=True)
    scheduler = scheduler_with(g)
    actions = [scheduler.schedule().action]
    for _ in range(2):
        actions.append(scheduler.schedule().action)
        scheduler.token_read("g")
        actions.append(scheduler.schedule().action)
    assert actions == ["prefill", "idle", "decode", "idle", "decode"]
    scheduler.token_read("g")
    with pytest.raises(AssertionError, match="before its step launched"):
        scheduler.token_read("g")


# ---- the `auto` prefill budget ------------------------------------------------------------------


def scored_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    request = make_request(request_id, prompt_len, max_tokens)
    request.prompt_logprobs = True
    return request


def test_a_scored_prompt_moves_one_chunk_per_step_of_its_own():
    """Each chunk of a prompt whose logprobs are returned is a prompt-logprobs step: alone, at most
    prompt_logprobs_chunk tokens, its targets the prompt tokens that follow each position."""
    request = scored_request("a", 20, 2)
    scheduler = scheduler_with(request, max_prefill_tokens=16, max_prefill_chunks=2, prompt_logprobs_chunk=8)
    plans = [scheduler.schedule() for _ in range(3)]
    assert all(plan.prompt_logprobs and plan.action == "prefill" and not plan.decode for plan in plans)
    assert [(c.start, len(c.token_ids), c.is_last) for plan in plans for c in plan.prefill] == [
        (0, 8, False), (8, 8, False), (16, 4, True)
    ]  # fmt: skip
    assert [t for plan in plans for t in plan.prefill[0].targets] == request.prompt_ids[1:]  # one fewer at the end
    assert not scheduler.schedule().prompt_logprobs and request.num_output_tokens == 2


def test_scored_steps_alternate_with_the_others_work():
    """A decoder and an ordinary prompt arriving behind a scored one: the scored chunks alternate with ordinary
    steps, which decode and prefill the other prompt; with nothing else to do, scored steps follow each other."""
    decoder, scored, ordinary = make_request("d", 3, 20), scored_request("s", 40, 2), make_request("o", 12, 2)
    scheduler = scheduler_with(decoder, max_prefill_tokens=8, prompt_logprobs_chunk=8)
    scheduler.schedule()  # the decoder's prompt
    scheduler.add(scored)
    scheduler.add(ordinary)
    plans = [scheduler.schedule() for _ in range(6)]
    assert [plan.prompt_logprobs for plan in plans] == [True, False, True, False, True, False]
    assert [[c.request_id for c in plan.prefill] for plan in plans[1::2]] == [["o"], ["o"], []]
    assert all(plan.decode and not plan.prompt_logprobs for plan in plans[1::2])
    scheduler.abort("d")
    scheduler.abort("o")
    assert [scheduler.schedule().prompt_logprobs for _ in range(2)] == [True, True]  # the last 16 of its 40


def test_max_tokens_zero_feeds_the_prompt_and_samples_nothing():
    request = scored_request("a", 10, 0)
    scheduler = scheduler_with(request, prompt_logprobs_chunk=16)
    plan = scheduler.schedule()
    assert plan.prompt_logprobs and plan.prefill[0].is_last and len(request.page_ids) == 3  # 10 tokens, 4 a page
    assert request.num_output_tokens == 0 and request.status is RequestStatus.DECODING
    assert scheduler.schedule().action == "idle"  # no decode row: the engine finishes it when the step is read
    scheduler.finish("a", "length")
    assert_pools_full(scheduler)


def test_prompt_logprobs_chunk_fits_the_prefill_budget():
    with pytest.raises(ValueError, match="prompt_logprobs_chunk .17. must be at most max_prefill_tokens .16."):
        make_config(max_prefill_tokens=16, prompt_logprobs_chunk=17)


def decoder_near_its_end(**overrides) -> tuple[Scheduler, list[StepPlan]]:
    """Decoder "d" with 5 tokens left after its prefill; prompt "p" (40 tokens) arrives behind it."""
    settings = dict(max_prefill_tokens=16, policy="auto") | overrides
    scheduler = scheduler_with(make_request("d", 4, 6), **settings)
    plans = [scheduler.schedule()]
    scheduler.add(make_request("p", 40, 4))
    plans += [scheduler.schedule(), scheduler.schedule()]
    return scheduler, plans


def test_auto_defers_prefill_while_a_decoder_is_in_the_finishing_window():
    scheduler, (_, outside, inside) = decoder_near_its_end()
    assert outside.budget == 16 and outside.action == "unified"  # "d" had 5 tokens left
    assert inside.budget == 0 and inside.action == "decode" and inside.prefill == ()  # 4 left
    assert scheduler.running["p"].num_computed_tokens == 16


def test_auto_keeps_prefilling_in_the_finishing_window_under_stream_overlap():
    scheduler, (_, _, inside) = decoder_near_its_end(decode_overlap="stream")
    assert inside.budget == 16 and inside.action == "overlap_launch"
    assert scheduler.running["p"].num_computed_tokens == 32


# ---- stream overlap -----------------------------------------------------------------------------


def test_overlap_budget_takes_the_largest_chunk_within_the_bound():
    costs = {(1, 0, 0): 1.0, (1, 1, 16): 1.5, (1, 1, 32): 1.9, (1, 1, 64): 3.0,
             (4, 0, 0): 2.0, (4, 1, 16): 4.5, (4, 1, 32): 5.0, (4, 1, 64): 6.0,
             (0, 1, 64): 2.5}  # fmt: skip
    budget = OverlapBudget.from_costs(costs, bound=2.0)
    # B=1: 32 tokens cost 1.9 <= 2.0; B=4: nothing fits 4.0, so the smallest chunk keeps the prompt moving.
    assert budget.limits == ((1, 32), (4, 16))
    assert [budget.tokens_for(n) for n in (1, 2, 4, 9)] == [32, 16, 16, 16]
    assert OverlapBudget.from_costs(costs, bound=3.0).limits == ((1, 64), (4, 64))
    with pytest.raises(ValueError, match="no unified step costs"):
        OverlapBudget.from_costs({(1, 0, 0): 1.0}, bound=2.0)


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_stream_overlap_caps_the_chunk_beside_decoders_only(policy):
    budget = OverlapBudget(((2, 8), (4, 4)))
    scheduler = scheduler_with(make_request("d", 2, 50), max_prefill_tokens=16, policy=policy,
                               decode_overlap="stream")  # fmt: skip
    scheduler.overlap_budget = budget
    assert scheduler.schedule().prefill[0].token_ids == tuple(range(1000, 1002))  # nothing decodes yet
    scheduler.add(make_request("p", 40, 4))
    plan = scheduler.schedule()  # one decoder: 8 tokens at most, under either policy
    assert plan.action == "overlap_launch" and len(plan.prefill[0].token_ids) == 8 and plan.budget == 8
    for r in ("q", "s"):
        scheduler.add(make_request(r, 2, 50))
    scheduler.schedule()
    # "p" still prefills; admitted "q" and "s" wait behind it as the FIFO front's chunks go (one per step).
    decoders = [r for r in scheduler.running.values() if r.remaining_prompt == 0 and r.remaining_tokens > 0]
    plan = scheduler.schedule()
    assert len(plan.decode) == len(decoders) and len(plan.prefill[0].token_ids) == budget.tokens_for(len(decoders))


def test_off_ignores_an_overlap_budget():
    scheduler = scheduler_with(make_request("d", 2, 50), max_prefill_tokens=16)
    scheduler.overlap_budget = OverlapBudget(((4, 4),))
    scheduler.schedule()
    scheduler.add(make_request("p", 40, 4))
    plan = scheduler.schedule()
    assert plan.action == "unified" and len(plan.prefill[0].token_ids) == 16


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_stream_overlap_leaves_prefill_only_steps_the_whole_cap(policy):
    """The budget caps a chunk beside decode rows only: before the first decoder, and once the last one has
    sampled its last token ("d" in step 1, inside auto's finishing window), the prompt takes the whole cap."""
    scheduler = scheduler_with(make_request("d", 2, 2), make_request("p", 40, 4), max_prefill_tokens=16,
                               policy=policy, decode_overlap="stream")  # fmt: skip
    scheduler.overlap_budget = OverlapBudget(((4, 4),))
    plans = [scheduler.schedule() for _ in range(3)]
    assert [(p.action, p.budget, p.num_prefill_tokens) for p in plans] == [
        ("prefill", 16, 2), ("overlap_launch", 4, 4), ("prefill", 16, 16)
    ]  # fmt: skip


def test_stream_actions_name_the_step_behind_an_overlapped_one():
    scheduler = scheduler_with(make_request("d", 2, 6), max_prefill_tokens=16, decode_overlap="stream")
    assert scheduler.schedule().action == "prefill"
    scheduler.add(make_request("p", 20, 4))
    actions = [scheduler.schedule().action for _ in range(4)]
    # 16 + 4 prompt tokens beside the decoder, then decode steps: the first behind the last launch is
    # overlap_decode (that launch is still in flight), the next a plain decode.
    assert actions == ["overlap_launch", "overlap_launch", "overlap_decode", "decode"]


def test_auto_budget_is_the_fifo_front_remainder_capped():
    scheduler = scheduler_with(make_request("d", 2, 50), max_prefill_tokens=16, max_prefill_chunks=2, policy="auto")
    scheduler.schedule()
    scheduler.add(make_request("front", 10, 4))
    scheduler.add(make_request("next", 10, 4))
    plan = scheduler.schedule()
    # The front's 10 tokens, not the cap: the decode step is not inflated by the next prompt.
    assert plan.budget == 10 and [c.request_id for c in plan.prefill] == ["front"]
    scheduler = scheduler_with(make_request("d", 2, 50), max_prefill_tokens=8, policy="auto")
    scheduler.schedule()
    scheduler.add(make_request("front", 10, 4))
    assert scheduler.schedule().budget == 8


def test_auto_without_decoders_grants_the_whole_cap():
    scheduler = scheduler_with(
        make_request("a", 5, 4),
        make_request("b", 5, 4),
        max_prefill_tokens=128,
        max_prefill_chunks=2,
        policy="auto",
    )
    plan = scheduler.schedule()
    assert plan.budget == 128 and plan.num_prefill_tokens == 10


def test_policy_off_ignores_the_finishing_window():
    _, (_, _, inside) = decoder_near_its_end(policy="off")
    assert inside.budget == 16 and inside.action == "unified"


# ---- samples of one prompt (n > 1) share its prefill --------------------------------------------------------


def samples_of(prompt_len: int, *ids: str, max_tokens: int = 4) -> list[Request]:
    requests = [make_request(request_id, prompt_len, max_tokens) for request_id in ids]
    for request in requests[1:]:
        request.fork_of = requests[0].request_id
    return requests


def test_samples_take_a_copy_of_the_first_ones_prefix_and_feed_the_last_token_themselves():
    scheduler = scheduler_with(*samples_of(20, "a", "b", "c"), max_prefill_tokens=16)
    plans = [scheduler.schedule() for _ in range(4)]
    chunks = [(c.request_id, c.start, c.end) for p in plans for c in p.prefill]
    assert chunks == [("a", 0, 16), ("a", 16, 19), ("a", 19, 20), ("b", 19, 20)]
    a, b, c = (scheduler.running[i] for i in "abc")
    # pages of 4 tokens: the 19-token prefix is in the first 5
    assert plans[1].copies == (StateCopy("b", a.slot, b.slot, a.page_ids[:5], b.page_ids[:5]),
                               StateCopy("c", a.slot, c.slot, a.page_ids[:5], c.page_ids[:5]))  # fmt: skip
    assert [p.copies for p in plans[2:]] == [(), ()] and c.num_computed_tokens == 19
    assert scheduler.schedule().prefill[0].request_id == "c"


def test_a_sample_prefills_itself_when_it_cannot_take_a_copy():
    # The first sample is aborted before its prefix is in: the others prefill from the start.
    scheduler = scheduler_with(*samples_of(20, "a", "b"), max_prefill_tokens=16)
    scheduler.schedule()
    scheduler.abort("a")
    assert [(c.request_id, c.start, c.end) for c in scheduler.schedule().prefill] == [("b", 0, 16)]
    # Admitted after the copy was made (max_batch 1: "b" waits for "a"'s slot): it prefills itself.
    scheduler = scheduler_with(*samples_of(6, "a", "b", max_tokens=1), max_batch=1, num_slots=2)
    plans = [scheduler.schedule() for _ in range(2)]
    assert [p.copies for p in plans] == [(), ()] and plans[1].prefill[0].end == 6
    scheduler.finish("a", "length")
    assert [(c.request_id, c.start, c.end) for c in scheduler.schedule().prefill] == [("b", 0, 6)]
    # Another prompt, a one-token prompt, or batch-invariant steps: no copy.
    for requests, overrides in [
        ([make_request("a", 5, 2), make_request("b", 6, 2)], {}),
        (samples_of(1, "a", "b"), {}),
        (samples_of(5, "a", "b"), {"batch_invariant": True}),
    ]:
        requests[1].fork_of = "a"
        scheduler = scheduler_with(*requests, max_prefill_tokens=16, **overrides)
        assert requests[1].fork_of is None and not any(scheduler.schedule().copies for _ in range(4))


# ---- batch-invariant steps (--deterministic) ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["off", "auto"])
def test_batch_invariant_steps_take_turns_and_cut_prompts_where_they_would_alone(policy):
    """A 40-token prompt arrives beside a decoder: its chunks (16, 16, 8 from its start) run in steps of their own,
    taking turns with decode steps, and no step packs both sides."""
    scheduler = scheduler_with(make_request("d", 3, 50), max_prefill_tokens=16, policy=policy, batch_invariant=True)
    assert scheduler.schedule().action == "prefill"
    scheduler.add(make_request("p", 40, 4))
    plans = [scheduler.schedule() for _ in range(7)]
    assert [p.action for p in plans] == ["decode", "prefill", "decode", "prefill", "decode", "prefill", "decode"]
    assert [(c.start, len(c.token_ids)) for p in plans for c in p.prefill] == [(0, 16), (16, 16), (32, 8)]
    assert [p.num_decode_rows for p in plans if p.decode] == [1, 1, 1, 2]  # "p" decodes once its prompt is in


def test_batch_invariant_steps_refuse_what_would_pack_two_sides():
    with pytest.raises(ValueError, match="max_prefill_chunks 1 and decode_overlap 'off'"):
        make_config(batch_invariant=True, max_prefill_chunks=2)
    with pytest.raises(ValueError, match="max_prefill_chunks 1 and decode_overlap 'off'"):
        make_config(batch_invariant=True, decode_overlap="stream")


# ---- abort and finish -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps_before_abort", "status", "remaining_tokens"),
    [
        (0, RequestStatus.WAITING, 3),
        (1, RequestStatus.PREFILLING, 3),
        (2, RequestStatus.PREFILLING, 3),
        (4, RequestStatus.DECODING, 1),
        (8, RequestStatus.DECODING, 0),  # done sampling, its last token not read yet
    ],
)
def test_abort_in_any_state_returns_everything(steps_before_abort, status, remaining_tokens):
    # A 40-token prompt in chunks of 16 is prefilled by steps 0-2 and samples in steps 2-4.
    request = make_request("a", 40, 3)
    scheduler = scheduler_with(request, make_request("b", 40, 3), max_prefill_tokens=16)
    for _ in range(steps_before_abort):
        scheduler.schedule()
    assert request.status is status and request.remaining_tokens == remaining_tokens
    assert scheduler.abort("a") and request.status is RequestStatus.FINISHED
    assert request.finish_reason == "abort" and "a" not in scheduler.running
    assert scheduler.abort("b") and not scheduler.abort("a") and not scheduler.abort("unknown")
    assert_pools_full(scheduler)
    assert not scheduler.has_work() and scheduler.schedule().action == "idle"


def test_trace_line():
    a, b = make_request("a", 3, 8), make_request("b", 20, 8)
    scheduler = scheduler_with(a, max_prefill_tokens=16)
    scheduler.schedule()
    scheduler.add(b)
    plan = scheduler.schedule()
    line = trace(plan)
    assert line == "ITL_STEP step=1 plan=unified decode_n=1 prefill_tok=16 prefill_reqs=1 budget=16"
    assert scheduler.trace(plan).startswith(line + " running=2 waiting=0 kv_use=")


def test_scheduler_modules_do_not_import_jax():
    code = (
        "import sys; import qwen35_jax.serving.scheduler, qwen35_jax.serving.plan, qwen35_jax.serving.pools;"
        "sys.exit('jax' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- property test: the scheduler driven like the engine drives it ------------------------------


class EngineModel:
    """Drives a scheduler as the engine does: schedule, then read the previous step's tokens and retire
    requests that reached their length limit. Checks every plan against its own token counts, and
    counts the situations it met in `seen` so that a test can show it exercised them."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.config = scheduler.config
        self.alive: dict[str, Request] = {}
        self.fed: dict[str, int] = {}  # prompt tokens launched, per request
        self.sampled: dict[str, int] = {}  # tokens whose sampling was launched
        self.read: dict[str, int] = {}  # tokens the host has read back
        self.in_flight: list[str] = []  # request ids that sample in the step in flight
        self.seen: collections.Counter[str] = collections.Counter()
        self.next_id = 0
        self.last_scored = False
        self.last_prefill_turn = False  # the last batch-invariant step carried a chunk

    def arrive(self, prompt_len: int, max_tokens: int, prompt_logprobs: bool = False) -> None:
        request = make_request(f"r{self.next_id}", prompt_len, max_tokens)
        request.prompt_logprobs = prompt_logprobs
        # Another sample of the latest live request with this prompt (make_request's prompts depend on length only).
        request.fork_of = next((i for i, r in reversed(self.alive.items()) if r.num_prompt_tokens == prompt_len), None)
        self.next_id += 1
        total = prompt_len + max_tokens
        never_fits = total > self.config.max_model_len or pages_needed(total, self.config.page_size) > (
            self.config.num_pages - 1
        )
        never_fits |= prompt_logprobs and not self.config.prompt_logprobs_chunk
        try:
            self.scheduler.add(request)
        except RequestRejected:
            assert never_fits
            self.seen["rejected"] += 1
            return
        assert not never_fits
        self.alive[request.request_id] = request
        self.fed[request.request_id] = self.sampled[request.request_id] = self.read[request.request_id] = 0

    def abort(self, index: int) -> None:
        # No drain first: the step in flight may still use the freed pages; `drain` drops its token.
        if self.alive:
            request = list(self.alive.values())[index % len(self.alive)]
            self.seen[f"abort {request.status}" + " done sampling" * (request.remaining_tokens == 0)] += 1
            assert self.scheduler.abort(request.request_id)
            del self.alive[request.request_id]

    def stop(self, index: int) -> None:
        """The host read an EOS for a request that has sampled at least one token."""
        candidates = [request_id for request_id in self.alive if self.read[request_id] > 0]
        if candidates:
            request_id = candidates[index % len(candidates)]
            assert self.scheduler.finish(request_id, "stop")
            del self.alive[request_id]
            self.seen["stop"] += 1

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            if self.scheduler.num_waiting and self.scheduler.num_running:
                self.seen["waiting behind running"] += 1
            others_wait = any(r.remaining_prompt == 0 < r.remaining_tokens or (r.remaining_prompt and not r.prompt_logprobs)
                              for r in self.scheduler.running.values())  # fmt: skip
            plan = self.scheduler.schedule()
            self.check_plan(plan)
            self.check_copies(plan)
            # Prompt-logprobs steps run back to back only while nothing else has work.
            assert not (plan.prompt_logprobs and self.last_scored and others_wait)
            self.last_scored = plan.prompt_logprobs
            in_flight = [row.request_id for row in plan.decode]
            in_flight += [chunk.request_id for chunk in plan.prefill if chunk.is_last]
            self.drain()
            self.in_flight = in_flight
            self.check_pools()

    def drain(self) -> None:
        """Read the tokens of the step in flight; retire requests at their length limit."""
        for request_id in self.in_flight:
            if request_id in self.alive:
                self.read[request_id] += 1
                max_tokens = self.alive[request_id].max_tokens
                if self.read[request_id] == max(max_tokens, 1):  # max_tokens 0: done when its prompt is in
                    assert self.scheduler.finish(request_id, "length")
                    del self.alive[request_id]
                    self.seen["length" if max_tokens else "prompt only"] += 1
        self.in_flight = []

    def finish_everything(self) -> None:
        for _ in range(10_000):  # every admitted request finishes; every waiting one gets admitted
            if not self.scheduler.has_work():
                break
            self.step()
        self.drain()
        assert not self.scheduler.has_work() and not self.alive
        assert_pools_full(self.scheduler)

    def check_plan(self, plan: StepPlan) -> None:
        config = self.config
        self.seen[plan.action] += 1
        assert plan.num_decode_rows <= config.max_batch and len(plan.prefill) <= config.max_prefill_chunks
        assert plan.num_prefill_tokens <= plan.budget <= config.max_prefill_tokens
        if plan.decode and len(plan.prefill) > 1:  # short chunks, of a length the packed unified programs hold
            assert len(plan.prefill) <= config.chunks_beside_decode, "decode rows beside several chunks"
            short = packed_unified_chunk_buckets(config.max_prefill_tokens, config.max_prefill_chunks)
            assert max(len(c.token_ids) for c in plan.prefill) <= short[-1]
            self.seen["packed beside decode"] += 1
        elif len(plan.prefill) > 1:  # the step's program exists: its padded tokens stay within one full chunk
            rows = bucket_for(len(plan.prefill), power_of_two_buckets(config.max_prefill_chunks))
            longest = bucket_for(
                max(len(c.token_ids) for c in plan.prefill), packed_chunk_buckets(config.max_prefill_tokens)
            )
            assert rows * longest <= config.max_prefill_tokens
            self.seen["packed"] += 1
        ids = [row.request_id for row in plan.decode] + [chunk.request_id for chunk in plan.prefill]
        assert len(ids) == len(set(ids)), "a request appears twice in one step"
        for row in plan.decode:
            self.check_decode_row(row)
        for chunk in plan.prefill:
            self.check_chunk(chunk)
        if plan.prompt_logprobs:
            (chunk,) = plan.prefill
            assert not plan.decode and len(chunk.token_ids) <= config.prompt_logprobs_chunk
            self.seen["prompt logprobs"] += 1
        assert all(self.alive[c.request_id].prompt_logprobs == plan.prompt_logprobs for c in plan.prefill)
        if config.batch_invariant:
            self.check_batch_invariant(plan)
        elif plan.budget == 0 and any(r.remaining_prompt for r in self.scheduler.running.values()):
            assert config.policy == "auto" and config.decode_overlap == "off"
            self.seen["prefill deferred"] += 1

    def check_batch_invariant(self, plan: StepPlan) -> None:
        """One side per step, and each chunk cut where the prompt alone would cut it: at multiples of its step
        kind's chunk length from the prompt's start."""
        assert not (plan.decode and plan.prefill), "a batch-invariant step carries both sides"
        for chunk in plan.prefill:
            length = self.config.prompt_logprobs_chunk if plan.prompt_logprobs else self.config.max_prefill_tokens
            assert chunk.start % length == 0
            assert len(chunk.token_ids) == min(length, self.alive[chunk.request_id].num_prompt_tokens - chunk.start)
        self.seen["batch-invariant turn"] += bool(plan.decode and self.last_prefill_turn)
        self.last_prefill_turn = bool(plan.prefill)

    def check_copies(self, plan: StepPlan) -> None:
        """A copy goes from the request whose chunk ends at the prefix in this plan to a sample of the same prompt
        that has fed nothing; the sample counts the prefix (all but the last prompt token) as fed."""
        for copy in plan.copies:
            request = self.alive[copy.request_id]
            leader = self.alive[request.fork_of]
            prefix = request.num_prompt_tokens - 1
            assert self.fed[copy.request_id] == 0 and any(c.request_id == leader.request_id and c.end == prefix
                                                          for c in plan.prefill)  # fmt: skip
            assert (copy.src_slot, copy.dst_slot) == (leader.slot, request.slot)
            pages = pages_needed(prefix, self.config.page_size)
            assert (copy.src_pages, copy.dst_pages) == (leader.page_ids[:pages], request.page_ids[:pages])
            assert not self.config.batch_invariant and not request.prompt_logprobs
            self.fed[copy.request_id] = prefix
            self.seen["prefix copied"] += 1

    def check_decode_row(self, row: DecodeRow) -> None:
        request = self.alive[row.request_id]
        assert self.fed[row.request_id] == request.num_prompt_tokens
        assert 0 < self.sampled[row.request_id] < request.max_tokens
        assert row.position == request.num_prompt_tokens + self.sampled[row.request_id] - 1
        assert row.position < len(row.page_ids) * self.config.page_size
        assert (row.slot, row.page_ids) == (request.slot, request.page_ids)
        self.sampled[row.request_id] += 1

    def check_chunk(self, chunk: PrefillChunk) -> None:
        request = self.alive[chunk.request_id]
        assert chunk.start == self.fed[chunk.request_id] and len(chunk.token_ids) > 0
        assert chunk.token_ids == tuple(request.prompt_ids[chunk.start : chunk.end])
        assert chunk.is_last == (chunk.end == request.num_prompt_tokens)
        scored = tuple(request.prompt_ids[chunk.start + 1 : chunk.end + 1]) if request.prompt_logprobs else ()
        assert chunk.targets == scored
        self.seen["partial chunk" if not chunk.is_last else "last chunk"] += 1
        self.fed[chunk.request_id] = chunk.end
        self.sampled[chunk.request_id] += chunk.is_last and request.max_tokens > 0

    def check_pools(self) -> None:
        scheduler = self.scheduler
        running = list(scheduler.running.values())
        assert len(running) <= self.config.max_batch
        pages = [page for request in running for page in request.page_ids]
        slots = [request.slot for request in running]
        assert len(set(pages)) == len(pages) and TRASH_PAGE not in pages, "a page is double-allocated"
        assert len(set(slots)) == len(slots) and scheduler.slot_pool.trash_slot not in slots
        assert len(pages) + scheduler.page_pool.num_free == scheduler.page_pool.num_total
        assert len(slots) + scheduler.slot_pool.num_free == scheduler.slot_pool.num_total
        for request in running:
            reserved = pages_needed(request.total_reserved_tokens, self.config.page_size)
            assert len(request.page_ids) == reserved
        # FCFS: every admitted request arrived before every waiting one, and the queue keeps arrival order.
        waiting = [arrival_number(request) for request in scheduler.waiting]
        assert waiting == sorted(waiting) and max(map(arrival_number, running), default=-1) < min(waiting, default=1e9)


def arrival_number(request: Request) -> int:
    return int(request.request_id.removeprefix("r"))


def random_config(pick: Callable[[int, int], int]) -> SchedulerConfig:
    """A small config; `pick(lo, hi)` draws an integer in [lo, hi] (from hypothesis or a seeded rng)."""
    # A third of the configs have room for several short chunks beside decode rows (128 tokens or more) and for
    # enough requests to fill them.
    wide = pick(0, 2) == 0
    max_batch, page_size = pick(3, 6) if wide else pick(1, 4), pick(1, 8)
    max_prefill_tokens = pick(128, 256) if wide else pick(1, 160)
    batch_invariant = pick(0, 3) == 0
    return SchedulerConfig(
        max_batch=max_batch,
        max_prefill_tokens=max_prefill_tokens,
        page_size=page_size,
        # From a pool that holds one short request to one that holds several long ones, so that both
        # rejection and waiting for pages happen.
        num_pages=1 + pick(pages_needed(16, page_size), pages_needed(120, page_size)),
        num_slots=max_batch + pick(1, 3),
        max_model_len=pick(16, 64),
        policy=("off", "auto")[pick(0, 1)],
        decode_overlap="off" if batch_invariant else ("off", "stream")[pick(0, 1)],
        max_prefill_chunks=1 if batch_invariant else pick(1, 3),
        finishing_window=pick(0, 5),
        prompt_logprobs_chunk=pick(0, max_prefill_tokens),
        batch_invariant=batch_invariant,
    )


operations = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 30), st.integers(0, 12), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("stop"), st.integers(0, 1000)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), ops=st.lists(operations, max_size=100))
def test_random_traffic_keeps_the_pools_consistent_and_drains(data, ops):
    engine = EngineModel(Scheduler(random_config(lambda lo, hi: data.draw(st.integers(lo, hi)))))
    for name, *args in ops:
        getattr(engine, name)(*args)
        engine.check_pools()
    engine.finish_everything()


def test_long_seeded_traffic_meets_every_situation():
    """Longer runs than hypothesis explores, which must reach every state the invariants are about."""
    seen = collections.Counter()
    for seed in range(40):
        rng = random.Random(seed)
        engine = EngineModel(Scheduler(random_config(rng.randint)))
        for _ in range(300):
            op = rng.choices(["arrive", "abort", "stop", "step"], weights=[4, 1, 1, 6])[0]
            if op == "arrive":
                engine.arrive(rng.randint(1, 30), rng.randint(0, 12), rng.random() < 0.3)
            elif op == "step":
                engine.step(rng.randint(1, 4))
            else:
                getattr(engine, op)(rng.randrange(1000))
        engine.finish_everything()
        seen += engine.seen
    situations = [
        "prefill", "decode", "unified", "idle", "partial chunk", "last chunk", "prefill deferred",
        "rejected", "waiting behind running", "stop", "length", "abort waiting", "abort prefilling",
        "abort decoding", "abort decoding done sampling", "prompt logprobs", "prompt only", "batch-invariant turn", "prefix copied", "packed",
        "packed beside decode",
    ]  # fmt: skip
    assert {name: seen[name] for name in situations if seen[name] == 0} == {}
