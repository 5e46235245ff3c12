"""Admission of one waiting request into the batch being formed (eLLM Alg. 1 in the server).

Upstream's ``PrefillAdder.add_one_req`` offers the waiting requests one by one. For each,
memx asks the one admission rule once, ``memory_ext.policy.prefill_admission.judge_prefill``
(the rule the simulator's eLLM scheduler scans its queue with), with the server's numbers in
KV tokens (``server_ask``):

* budget: free + evictable KV (upstream's ``available + evictable``, which with elastic KV
  counts FREE and idle activation chunks as growable, in whole groups);
* reserved / reserved now: upstream's prefill budget offsets (the running requests' decode
  reservation and the batch so far / what the batch occupies now);
* the request's KV as upstream reserves it (the rest of its input, a page, its clipped
  max_new) and, if offloaded, what its next chunk occupies on the device now;
  the batch's activation with it, as what making it live takes from that budget
  (``ElasticKV.activation_cost_pages``: FREE and idle chunks first, whole groups only when
  KV must shrink, the last group at its usable size); and, with a host buffer, what parking
  its KV would cost;
* whether a parked request is ahead of it in this pass (then it may only go to the buffer).

Then it acts on the verdict. ``ON_GPU``: the batch's activation chunks are reserved
(``ballooning``) and upstream's own admission runs (it may still refuse, e.g. on its request or
token caps; then the verdict's ``if_refused`` says whether the offload branch is tried).
``OFFLOAD``: upstream's admission runs against the physical room only (``physical_check``) and
the request's KV is parked after its prefill (``host_buffer``). ``DEFER``: the request waits
(counted in ``offload_no_room`` when only the buffer's room was short); a request whose KV waits
on the host lets later requests prefill into the buffer, but none is admitted normally ahead of
it (first come, first served).

With the governor (``--memx-tpot-slo-ms`` or ``--memx-governor``: ``coordinator.governor``), the question is
``memory_ext.policy.no_harm.govern_prefill``, the call the simulator's ``governed_ellm`` scheduler
makes: the verdict above passes the governor, which lets a refusal or a parking stand only with a
predicted gain (``server_growth``: the running requests' peak KV demand with the request would
exceed the budget, i.e. admitting it would preempt one, with each request's decode estimated as
upstream's admission estimates it); otherwise the on-device branch runs and
upstream's own admission decides, as it would without memx. With a TPOT SLO, no branch parks a
request whose own predicted TPOT, its wait on the host for device room included, is over it
(``GovernorPart.park_tpot``, ``memory_ext.policy.park_tpot``; reason ``park_over_tpot``). Each
governed verdict is counted by reason (``GovernorPart.note_verdict``, ``/memx/status``).
"""

from __future__ import annotations

import math
from typing import Protocol

from memory_ext.policy.no_harm import (
    STOCK,
    STOCK_ELSE_PARK,
    GovernedVerdict,
    Running,
    govern_prefill,
)
from memory_ext.policy.park_tpot import ParkTpot
from memory_ext.policy.prefill_admission import DEFER, OFFLOAD, ON_GPU, PrefillAsk, PrefillVerdict, judge_prefill
from memory_ext.pool.lent_pool import LentPool
from sglang_memx.elastic import demand, host_buffer
from sglang_memx.elastic.activation_side import ActivationSide
from sglang_memx.elastic.host_state import HostBufferState
from sglang_memx.upstream import request as up_req
from sglang_memx.upstream import scheduler as up_sched


class AdmissionGovernor(Protocol):
    """What admission asks of the device's governor (``coordinator.governor.GovernorPart``); a
    protocol because this package never imports the coordinator above it."""

    def may_grow(self, running_reqs, admitted_reqs, req): ...

    def note_verdict(self, verdict: GovernedVerdict) -> None: ...

    def park_tpot(self, running_reqs, req) -> ParkTpot | None: ...


def _decode_headroom(adder, steps: int = 1) -> int:
    """Device room an offloaded prefill leaves: one page per running request for each of the
    ``steps`` iterations its prompt takes (its chunks), and one page for itself."""
    return up_sched.adder_page_size(adder) * (up_sched.adder_running_count(adder) * steps + 1)


def _chunks(rest: int, chunk: int) -> int:
    """Iterations a prompt's ``rest`` takes in chunks of ``chunk`` tokens."""
    return max(1, -(-rest // max(chunk, 1)))


def _paged(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


def server_ask(adder, req, chunk: int, has_chunked_req: bool, activation: ActivationSide,
               host: HostBufferState | None) -> PrefillAsk:  # fmt: skip
    """The admission rule's inputs for ``req`` in this pass, in KV tokens (``activation``: the
    coordinator's activation side; ``host``: the host buffer, if any)."""
    budget = up_sched.adder_budget(adder)
    total, current = up_sched.budget_offsets(budget)
    page = up_sched.adder_page_size(adder)
    state = up_sched.adder_state(adder)
    # what making the batch's activation live takes from the budget (in KV tokens)
    act = activation.admission_cost_pages(state.batch_tokens + chunk, up_sched.adder_batch_size(adder) + 1) * page
    offload_kv = room = 0
    if (host is not None and not has_chunked_req and not up_sched.adder_has_chunked(adder)
            and up_req.is_plain_text_request(req) and up_sched.is_physical_budget(budget)):  # fmt: skip
        row = demand.kv_row_bytes(up_sched.adder_allocator(adder))
        offload_kv = up_req.fill_len(req)
        room = host.offload_room() // row
    rest = demand.next_chunk_tokens(req, None)  # the whole rest of its input, as upstream reserves it
    running_steps = page * up_sched.adder_running_count(adder) * _chunks(rest, chunk)
    return PrefillAsk(
        budget=up_sched.budget_free(budget),
        # an offloaded chunked prefill under way holds the rest of its prompt on the device
        reserved=total + state.offload_rest,
        # + the running requests' decode while this prompt's chunks run
        reserved_now=current + state.offload_rest + running_steps,
        kv=rest + page + up_req.remaining_new_tokens(req),
        kv_now=_paged(rest, page) + page,  # an offloaded prompt lands on the device whole before it parks
        act=act,
        offload_kv=offload_kv,
        buffer_room=room,
        # first come, first served: a request the buffer could not take may not pass a parked one
        parked_ahead=bool(state.behind_parked and up_req.is_plain_text_request(req)),
    )


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


def server_growth(adder, req) -> tuple[list[Running], int]:
    """What ``no_harm.govern_prefill`` predicts the harm from, in pages: this pass's running
    requests (the running batch's and those admitted so far) and ``req``, each with its KV tokens
    (prompt + output so far), the tokens it is expected to still generate and, when it finishes,
    all its pages (a finished request's KV is free or evictable); and the pages the prompts not yet
    on the device take at once (this pass's and ``req``'s rest).

    Expected tokens: upstream's own estimate (``demand.expected_new_tokens``: the remaining
    ``max_new_tokens``, clipped, times this pass's new-token ratio, or all of it with ignore_eos),
    rounded up; one fewer for a request whose prefill is still to run, which yields one. So the
    governor predicts harm from the decode stock's admission reserves for, not from the
    ``max_new_tokens`` upper bound (a chat request without ``max_tokens`` asks for the context)."""
    page = up_sched.adder_page_size(adder)
    ratio = up_sched.adder_new_token_ratio(adder)
    running, now = [], 0
    admitted = (*up_sched.adder_admitted_list(adder), req)
    for r in (*up_sched.adder_running_reqs(adder), *admitted):
        tokens = up_req.prompt_len(r) + up_req.output_len(r)
        expected = math.ceil(demand.expected_new_tokens(r, ratio))
        remaining = max(expected - (1 if any(r is a for a in admitted) else 0), 0)  # the prefill's token
        running.append(Running(tokens, remaining, _pages(tokens + remaining, page)))
    for r in admitted:
        now += _pages(demand.next_chunk_tokens(r, None), page)
    return running, now


def add_one(original, adder, req, has_chunked_req, truncation_align_size, activation: ActivationSide,
            host: HostBufferState | None, lent: LentPool | None,
            governor: AdmissionGovernor | None = None):  # fmt: skip
    """``PrefillAdder.add_one_req`` with memx's admission rule in front (module docstring):
    one question, then the verdict's branches. With the governor (``coordinator.governor``) the
    question is ``no_harm.govern_prefill`` (the verdict passed through the governor, ``_as_verdict``)."""
    state = up_sched.adder_state(adder)
    chunk = demand.next_chunk_tokens(req, up_sched.adder_chunk_room(adder))
    ask = server_ask(adder, req, chunk, has_chunked_req, activation, host)
    if governor is None:
        verdict = judge_prefill(ask)
    else:
        running, now_pages = server_growth(adder, req)
        park = governor.park_tpot(up_sched.adder_batch_reqs(adder), req)
        verdict, gv = govern_prefill(ask, running, up_sched.adder_page_size(adder), now_pages, park=park)
        governor.note_verdict(gv)
        verdict = _as_verdict(gv, verdict)
    if verdict.action == DEFER:
        return _defer(host, adder, req, verdict.buffer_full)
    live_before = activation.live_chunks()
    allocator = up_sched.adder_allocator(adder)
    if not activation.reserve(allocator, None, state.batch_tokens + chunk, up_sched.adder_batch_size(adder) + 1,
                              lent=lent):  # fmt: skip
        activation.count("deferred_requests")
        return up_sched.add_result("NO_TOKEN")
    if verdict.action == ON_GPU:
        result = original(adder, req, has_chunked_req, truncation_align_size)
        if not up_sched.adder_admitted(adder, req) and verdict.if_refused == OFFLOAD:  # the buffer may take it
            result = _offload(original, adder, req, has_chunked_req, truncation_align_size, host)
    else:
        result = _offload(original, adder, req, has_chunked_req, truncation_align_size, host)
    if not up_sched.adder_admitted(adder, req):
        activation.set_live_chunks(live_before)  # not admitted: its share goes back to idle (KV may take it)
        return result
    state.batch_tokens += chunk
    if host is not None:
        host_buffer.note_admitted(host, req, up_sched.adder_tree_cache(adder))
    return result


def _as_verdict(gv: GovernedVerdict, verdict: PrefillVerdict) -> PrefillVerdict:
    """The governed action as the branches of ``add_one`` take it: ``STOCK`` is the on-device
    branch (the batch's activation is still made live, then upstream's own admission decides),
    ``STOCK_ELSE_PARK`` the same with the buffer as its fallback; a governed ``DEFER`` keeps the
    mechanism's buffer-full reason only if the mechanism deferred too."""
    if gv.action == STOCK:
        return PrefillVerdict(ON_GPU)
    if gv.action == STOCK_ELSE_PARK:
        return PrefillVerdict(ON_GPU, if_refused=OFFLOAD)
    if gv.action == DEFER:
        return PrefillVerdict(DEFER, buffer_full=verdict.action == DEFER and verdict.buffer_full)
    if gv.action == OFFLOAD:
        return PrefillVerdict(OFFLOAD)
    return verdict  # ON_GPU: the mechanism's own verdict (its fallback included)


def governor_refusal(governor: AdmissionGovernor, adder, req):
    """Before ``req`` joins the running batch: the governor's batch decision (``coordinator.governor``:
    the predicted TPOT of the running requests with it within the SLO). None: go on to admission;
    else upstream's own "stop adding" result (``OTHER``: the pass ends, the request stays waiting
    and is offered again next iteration, as when upstream refuses it; nothing is dropped)."""
    if governor.may_grow(up_sched.adder_running_reqs(adder), up_sched.adder_admitted_list(adder), req).admit:
        return None
    return up_sched.add_result("OTHER")


def _defer(host: HostBufferState | None, adder, req, buffer_full: bool):
    if host is not None and up_req.rid(req) in host.buffer:  # prefilled already, waiting for room to decode
        up_sched.adder_state(adder).behind_parked = True
        return up_sched.add_result("CONTINUE")  # requests behind it may still prefill into the buffer
    if buffer_full:
        host.offload["offload_no_room"] += 1  # it would have prefilled, but the buffer is full
    return up_sched.add_result("NO_TOKEN")


def _offload(original, adder, req, has_chunked_req, truncation_align_size, host: HostBufferState):
    """Upstream's admission against the device's physical room; the KV is parked after the prefill."""
    budget = up_sched.adder_budget(adder)
    steps = _chunks(
        demand.next_chunk_tokens(req, None), demand.next_chunk_tokens(req, up_sched.adder_chunk_room(adder))
    )
    with up_sched.physical_check(budget, _decode_headroom(adder, steps), up_req.remaining_new_tokens(req)):
        original(adder, req, has_chunked_req, truncation_align_size)
    if not up_sched.adder_admitted(adder, req):
        return up_sched.add_result("NO_TOKEN")
    host_buffer.mark_offloaded(host, req, host_buffer.offload_bytes(req, up_sched.adder_allocator(adder)))
    chunk_room = up_sched.adder_chunk_room(adder)
    if up_sched.adder_input_room(adder) <= 0 or (chunk_room is not None and chunk_room <= 0):
        return up_sched.add_result("OTHER")
    if up_sched.budget_free(budget) - up_sched.budget_offsets(budget)[1] > _decode_headroom(adder):
        return up_sched.add_result("CONTINUE")
    return up_sched.add_result("NO_TOKEN")


def add_chunk(original, adder, req, activation: ActivationSide, lent: LentPool | None):
    """``PrefillAdder.add_chunked_req``: the next chunk of a chunked prefill makes its activation
    live (held since the tick), so KV cannot take it; it cannot wait (it holds KV), so a
    shortfall is only counted. An offloaded prefill's chunks are sized by the physical room."""
    allocator = up_sched.adder_allocator(adder)
    chunk = demand.next_chunk_tokens(req, up_sched.adder_chunk_room(adder))
    if not activation.reserve(allocator, None, chunk, 1, lent=lent):
        activation.count("overcommitted_chunks")
    if host_buffer.is_offloaded(req):
        rest = demand.next_chunk_tokens(req, None)
        chunk = demand.next_chunk_tokens(req, up_sched.adder_chunk_room(adder))
        with up_sched.physical_check(up_sched.adder_budget(adder), _decode_headroom(adder, _chunks(rest, chunk)), 0):
            result = original(adder, req)
        if rest > chunk:  # later requests of this pass must leave the rest of its prompt room
            up_sched.adder_state(adder).offload_rest = rest - chunk + up_sched.adder_page_size(adder)
        return result
    return original(adder, req)
