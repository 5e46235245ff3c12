"""The compute board (issue 26 item 4): a busy engine computes on its idle siblings' cores and
gives them back the moment a sibling has work; the policy's table, the shared file across
processes, the engine-side lender and the launcher's variables."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from memory_ext.policy.compute_share import ComputeShareError, ComputeShares, Offer, cores_for, offer, siblings_quiet
from memory_ext.policy.lending_trial import LendingTrial
from memory_ext.pool.compute_board import ComputeBoard, ComputeBoardError, SlotState
from sglang_memx import compute_share
from sglang_memx.compute_share import ComputeLender, from_environment

TWO = ComputeShares(((0,), (1,)))
THREE_ON_SIX = ComputeShares(((0, 1), (2, 3), (4, 5)))
THREE = ComputeShares(((0,), (1,), (2,)))


@pytest.mark.parametrize(
    "table, busy, want",
    [
        # nobody busy: everyone on its own share
        (TWO, [False, False], [(0,), (1,)]),
        # one busy of two: it computes on both cores; the idle one keeps its own (it has nothing to run)
        (TWO, [True, False], [(0, 1), (1,)]),
        (TWO, [False, True], [(0,), (0, 1)]),
        # both busy: the static split exactly
        (TWO, [True, True], [(0,), (1,)]),
        # three engines: two busy share the idle one's cores, dealt in slot order
        (THREE_ON_SIX, [True, True, False], [(0, 1, 4), (2, 3, 5), (4, 5)]),
        (THREE_ON_SIX, [False, True, False], [(0, 1), (0, 1, 2, 3, 4, 5), (4, 5)]),
        (THREE_ON_SIX, [True, True, True], [(0, 1), (2, 3), (4, 5)]),
        # fewer cores than engines (shares overlap): a busy engine never takes a busy one's core
        (ComputeShares(((0,), (1,), (0,))), [True, False, True], [(0, 1), (1,), (0,)]),
        (ComputeShares(((0,), (1,), (0,))), [False, True, False], [(0,), (0, 1), (0,)]),
    ],
)
def test_cores_follow_who_has_work(table, busy, want):
    got = [cores_for(slot, table, busy) for slot in range(table.slots)]
    assert got == want
    busy_cores = [c for slot, cores in enumerate(got) if busy[slot] for c in cores]
    if sum(map(len, table.shares)) == len({c for s in table.shares for c in s}):  # disjoint shares
        assert len(busy_cores) == len(set(busy_cores))  # busy engines never share a core
    for slot in range(table.slots):
        assert set(table.shares[slot]) <= set(got[slot])  # an engine always keeps its own share


def test_bad_tables_and_questions_name_the_field():
    with pytest.raises(ComputeShareError, match="shares: at least one"):
        ComputeShares(())
    with pytest.raises(ComputeShareError, match=r"shares\[1\]: an engine needs at least one core"):
        ComputeShares(((0,), ()))
    with pytest.raises(ComputeShareError, match=r"shares\[0\]: core -1"):
        ComputeShares(((-1,),))
    with pytest.raises(ComputeShareError, match="shares: '0;x'"):
        ComputeShares.parse("0;x")
    with pytest.raises(ComputeShareError, match="slot: 2"):
        cores_for(2, TWO, [True, True])
    with pytest.raises(ComputeShareError, match="busy: 3 flags"):
        cores_for(0, TWO, [True, True, False])
    assert ComputeShares.parse(THREE_ON_SIX.render()) == THREE_ON_SIX


_WRITER = """
import os, sys, time
from memory_ext.pool.compute_board import ComputeBoard
ComputeBoard.open(sys.argv[1]).publish(1, os.getpid(), True, 5.0)
print("ready", flush=True)
time.sleep(60)
"""


def test_board_is_shared_across_processes_and_a_dead_writer_reads_idle(tmp_path):
    path = tmp_path / "pool.compute"
    board = ComputeBoard.create(path, 2)
    assert board.busy_flags() == [False, False]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert board.busy_flags() == [False, True]
        assert board.read(1).pid == child.pid and board.read(1).stamp == 5.0
        child.kill()  # dies busy: its cores must not stay lent
        child.wait(30)
        assert board.busy_flags() == [False, False]
        assert board.busy_flags(own_slot=1) == [False, True]  # the caller's own slot: its word, no pid read
        dead = board.states()[1]  # read as idle, its pid and last-busy stamp kept
        assert (dead.busy, dead.pid, dead.stamp) == (False, child.pid, 5.0)
        # a busy stamp fresher than FRESH_S is taken on its word (no /proc read); a stale one is not
        assert board.busy_flags(now=5.0 + ComputeBoard.FRESH_S / 2) == [False, True]
        assert board.busy_flags(now=5.0 + ComputeBoard.FRESH_S) == [False, False]
        assert board.busy_flags(now=4.0) == [False, False]  # a stamp from the future is not fresh
    finally:
        child.kill()
        child.wait(30)
    board.publish(0, os.getpid(), True, 6.0)
    assert board.busy_flags() == [True, False]


def test_a_file_that_is_not_a_board_is_refused_naming_it(tmp_path):
    bad = tmp_path / "x.compute"
    bad.write_bytes(b"not a board at all, really")
    with pytest.raises(ComputeBoardError, match="x.compute: not a compute board"):
        ComputeBoard.open(bad)
    with pytest.raises(ComputeBoardError, match="missing.compute: cannot open"):
        ComputeBoard.open(tmp_path / "missing.compute")
    board = ComputeBoard.create(tmp_path / "ok.compute", 2)
    with pytest.raises(ComputeBoardError, match="slot 2 is not one of 2"):
        board.publish(2, 1, True, 0.0)


@pytest.mark.parametrize(
    "slot,last_busy,now,quiet",
    [
        (0, [5.0, 0.0], 1.0, True),  # the only sibling never busy
        (0, [5.0, 9.0], 10.0, False),  # busy 1 s ago
        (0, [5.0, 8.0], 10.0, True),  # exactly quiet_s ago
        (1, [9.5, 0.0, 3.0], 10.0, False),  # one of two siblings busy moments ago
        (1, [7.0, 0.0, 3.0], 10.0, True),
    ],
)
def test_siblings_quiet(slot, last_busy, now, quiet):
    assert siblings_quiet(slot, last_busy, now, 2.0) is quiet


def test_siblings_quiet_refuses_a_bad_quiet_time():
    with pytest.raises(ComputeShareError, match="quiet_s: must be >= 0"):
        siblings_quiet(0, [0.0, 0.0], 1.0, -1.0)


_TWO = ComputeShares(((0,), (1,)))


@pytest.mark.parametrize(
    "busy,last_busy,now,want",
    [
        ([True, True], [9.0, 9.0], 10.0, Offer((0,), False, False)),  # a busy sibling keeps its core
        ([True, False], [9.0, 9.5], 10.0, Offer((0,), True, False)),  # sibling idle 0.5 s: own core only
        ([True, False], [9.0, 8.0], 10.0, Offer((0, 1), True, True)),  # idle 2 s: the whole device
        ([True, False], [9.0, 0.0], 10.0, Offer((0, 1), True, True)),  # never busy
        ([False, False], [9.0, 0.0], 10.0, Offer((0,), True, True)),  # an idle engine keeps its own
    ],
)
def test_the_offer_folds_the_quiet_rule_into_the_cores(busy, last_busy, now, want):
    assert offer(0, _TWO, busy, last_busy, now, 2.0) == want


def test_the_offer_refuses_stamps_that_do_not_match_the_slots():
    with pytest.raises(ComputeShareError, match="last_busy: 1 stamps for 2 engine slots"):
        offer(0, _TWO, [True, False], [0.0], 1.0, 2.0)


def test_two_lenders_lend_and_take_back_cores(tmp_path):
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 2).close()
    applied = {0: [], 1: []}

    # the board's mechanics: a trial that has measured lending to pay (the trial's own tests below)
    def paid():
        return LendingTrial(phase="lend", until=1e9)

    a = ComputeLender(ComputeBoard.open(path), 0, TWO, apply=applied[0].append, trial=paid())
    b = ComputeLender(ComputeBoard.open(path), 1, TWO, apply=applied[1].append, trial=paid())
    assert a.step(False, 1.0) == (0,) and b.step(False, 1.0) == (1,)  # first step: own share set
    assert a.step(True, 2.0) == (0, 1)  # b is idle: a computes on both cores
    assert b.step(True, 3.0) == (1,)  # b has work: it starts on its own share at once ...
    assert a.step(True, 3.1) == (0,)  # ... and a gives core 1 back at its next iteration
    assert b.step(False, 4.0) == (1,) and a.step(True, 4.1) == (0,)  # b was busy 1.1 s ago: not yet
    assert a.step(True, 5.0) == (0, 1)  # b idle for the quiet time (2 s since its last busy iteration)
    assert applied[0] == [(0,), (0, 1), (0,), (0, 1)] and applied[1] == [(1,)]
    assert a.changes == 4 and a.status()["busy_slots"] == [0] and a.status()["own_cores"] == [0]
    assert a.status()["whole_device_after_idle_s"] == 2.0


def test_the_board_stamps_the_last_busy_iteration_and_the_whole_device_waits_for_quiet(tmp_path):
    """A sibling's stamp is the time it last published itself busy; the whole device is offered
    only once every sibling has been idle for ``quiet_s``, so a sibling with steady traffic (a
    request every second, say) never meets our threads on its core when its next one arrives."""
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 2).close()
    board = ComputeBoard.open(path)
    board.publish(1, os.getpid(), True, 10.0)
    board.publish(1, os.getpid(), False, 10.5)
    assert board.read(1) == SlotState(os.getpid(), False, 10.0)  # idle since its busy iteration at 10.0
    a = ComputeLender(ComputeBoard.open(path), 0, TWO, apply=lambda c: None, quiet_s=3.0)
    assert [a.step(True, t) for t in (11.0, 12.9)] == [(0,), (0,)]  # quiet for 1.0 s, 2.9 s: own core
    assert a.status()["siblings_quiet"] is False
    assert a.step(True, 13.0) == (0, 1)  # 3 s: the whole device (its trial's first block)
    assert a.status()["siblings_quiet"] is True
    board.publish(1, os.getpid(), True, 13.5)
    assert a.step(True, 13.6) == (0,)  # the sibling has work: its core back at once
    board.publish(1, os.getpid(), False, 13.7)
    assert a.step(True, 14.0) == (0,) and a.step(True, 16.5) == (0, 1)


def test_environment_makes_the_lender_and_bad_variables_name_themselves(tmp_path):
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 2).close()
    env = {compute_share.BOARD_ENV: str(path), compute_share.SLOT_ENV: "1", compute_share.SHARES_ENV: "0;1"}
    lender = from_environment(env)
    assert lender.slot == 1 and lender.table == TWO
    assert from_environment({}) is None  # alone (no launcher board): nothing to do
    with pytest.raises(ValueError, match="MEMX_COMPUTE_SLOT: 'x'"):
        from_environment({**env, compute_share.SLOT_ENV: "x"})
    with pytest.raises(ValueError, match="MEMX_COMPUTE_SLOT: slot 2 of 2"):
        from_environment({**env, compute_share.SLOT_ENV: "2"})
    with pytest.raises(ValueError, match="MEMX_COMPUTE_SLOT: slot 0 of 3 shares on a board of 2"):
        from_environment({**env, compute_share.SLOT_ENV: "0", compute_share.SHARES_ENV: "0;1;1"})


def test_a_lender_stops_lending_when_the_lent_cores_are_measured_slower(tmp_path):
    """One sibling idle, another busy, lending on offer: the engine starts on its own core, tries
    the lent ones, and goes back to its own when the lent iterations are slower per running request."""
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 3).close()
    ComputeBoard.open(path).publish(2, os.getpid(), True, 0.0)  # slot 2 has work: the trial decides
    applied = []
    a = ComputeLender(ComputeBoard.open(path), 0, THREE, apply=applied.append, trial=LendingTrial(block=2, pairs=1))
    t, cores = 0.0, []
    for _ in range(12):  # own iterations take 1 ms, lent ones 50 ms (a stalled barrier)
        cores.append(a.step(True, t, decoded=4))
        t += 0.001 if cores[-1] == (0,) else 0.050
    assert cores[:3] == [(0,)] * 3  # the first change is not counted, then 2 own iterations
    assert (0, 1) in cores  # the trial's lent block
    assert cores[-4:] == [(0,)] * 4 and a.trial.phase == "own" and a.trial.refused == 1
    assert "slower" in a.status()["lending"]["reason"] or "needs <=" in a.status()["lending"]["reason"]


def test_a_lender_keeps_lending_when_the_lent_cores_are_faster(tmp_path):
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 3).close()
    ComputeBoard.open(path).publish(2, os.getpid(), True, 0.0)  # slot 2 has work: the trial decides
    a = ComputeLender(ComputeBoard.open(path), 0, THREE, apply=lambda c: None, trial=LendingTrial(block=2, pairs=2))
    t, cores = 0.0, []
    for _ in range(20):  # lent iterations take half as long
        cores.append(a.step(True, t, decoded=2))
        t += 0.002 if cores[-1] == (0,) else 0.001
    assert a.trial.phase == "lend" and a.trial.paid == 1 and cores[-5:] == [(0, 1)] * 5
    assert "lending" in a.status()["lending"]["reason"]


def test_prefill_iterations_do_not_count_so_they_cannot_fake_a_gain(tmp_path):
    """Each request starts with a slow prefill iteration, and own blocks come first, right after
    arrivals: counted, prefills made the own cores look slow. Decode steps take the same time on
    both sides here, so the lender must not lend (a third sibling is busy: the lent cores must
    pay); every prefill alone would have said 'pays'."""
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 3).close()
    ComputeBoard.open(path).publish(2, os.getpid(), True, 0.0)  # slot 2 has work: lending must pay
    a = ComputeLender(ComputeBoard.open(path), 0, THREE, apply=lambda c: None, trial=LendingTrial(block=2, pairs=2))
    t, prefill_next = 0.0, True
    for i in range(40):
        if a.trial.phase != "trial":
            break
        # the iteration that just ended: a prefill (not counted) or a decode step of 1 request
        a.step(True, t, decoded=0 if prefill_next else 1)
        lent = a.cores == (0, 1)
        prefill_next = not lent and i % 3 == 0  # prefills land in own blocks (after arrivals)
        t += 0.050 if prefill_next else 0.010
    assert a.trial.phase == "own" and a.trial.paid == 0, a.status()["lending"]
    assert a.trial.own_costs and a.trial.own_costs + a.trial.lent_costs == pytest.approx([0.010] * 8)  # decodes only


def test_a_pair_that_contradicts_the_gain_keeps_own_cores():
    """Median over both pairs says lent is 0.5x, but in the second pair the lent block was slower
    than its own block: the measurement is not consistent, so no lending (the benchmark rule)."""
    trial = LendingTrial(block=2, pairs=2)
    costs = {False: [0.010, 0.010, 0.010, 0.010], True: [0.002, 0.002, 0.012, 0.012]}
    taken = {False: 0, True: 0}
    now = 0.0
    while trial.phase == "trial":
        lent = trial.want_lent(now)
        cost = costs[lent][taken[lent]]
        taken[lent] += 1
        now += cost
        trial.observe(lent, cost, 1, now)
    assert trial.phase == "own" and trial.refused == 1
    assert "slower in pair(s) [2] of 2" in trial.reason, trial.reason


def _run_trial(own_s: float, lent_s: float) -> LendingTrial:
    """A trial whose own and lent iterations take ``own_s`` / ``lent_s``, run to its verdict."""
    trial = LendingTrial(block=3, pairs=2)
    now = 0.0
    for _ in range(40):
        if trial.phase != "trial":
            break
        lent = trial.want_lent(now)
        now += lent_s if lent else own_s
        trial.observe(lent, lent_s if lent else own_s, 1, now)
    return trial


@pytest.mark.parametrize(
    "own_s,lent_s,phase",
    [
        (0.010, 0.005, "lend"),  # 2x faster: pays
        (0.010, 0.0095, "own"),  # 5 % faster: not the 10 % the rule asks for
        (0.010, 0.012, "own"),  # slower
        (0.010, 0.5, "own"),  # a stall: bails out after one lent block
    ],
)
def test_the_trial_verdict(own_s, lent_s, phase):
    assert _run_trial(own_s, lent_s).phase == phase


def _run_whole_device_trial(own_s: float, lent_s: float, stall_s: float = 0.0) -> tuple[LendingTrial, list[bool]]:
    """A ``prefer_lent`` trial (every sibling idle) run to its verdict; returns it and its sides.
    ``stall_s``: the first iteration of each lent block takes this long instead."""
    trial, sides, now = LendingTrial(block=3, pairs=3, gain=0.95, prefer_lent=True), [], 0.0
    for _ in range(40):
        if trial.phase != "trial":
            break
        lent = trial.want_lent(now)
        first_of_block = lent and (not sides or not sides[-1])
        sides.append(lent)
        cost = (stall_s or lent_s) if first_of_block else (lent_s if lent else own_s)
        now += cost
        trial.observe(lent, cost, 1, now)
    return trial, sides


@pytest.mark.parametrize(
    "own_s,lent_s,phase",
    [
        (0.010, 0.005, "lend"),  # the whole device 2x faster
        (0.010, 0.010, "lend"),  # equal: stock's configuration
        (0.010, 0.0103, "lend"),  # own 3 % faster: not the 5 % it takes to leave the default
        (0.010, 0.012, "own"),  # own 17 % faster in every pair: own cores (a model too small for 2 threads)
        (0.010, 0.5, "own"),  # a stall on the whole device: > 2x at one batch, the first pair decides
    ],
)
def test_the_whole_device_trial_weighs_every_pair_then_lends_unless_own_cores_are_faster(own_s, lent_s, phase):
    trial, sides = _run_whole_device_trial(own_s, lent_s)
    bailed = lent_s > 2 * own_s
    assert trial.phase == phase and len(sides) == (6 if bailed else 18)  # else no verdict before the 3 pairs of 3
    assert ("bailed out" in trial.reason) is bailed
    assert sides[:3] == [True] * 3 and sides[3:6] == [False] * 3  # the default's side (the whole device) first
    assert ("own cores for 10 s" in trial.reason) is (phase == "own")
    assert "(means)" in trial.reason


def test_the_whole_device_trial_counts_the_stalls_a_median_hides():
    """The whole device as fast as the own cores on most iterations, but its first iteration of
    each block stalls (a helper process finding no free core): the medians are equal, the means
    are not, and the own cores are kept."""
    trial, _ = _run_whole_device_trial(0.010, 0.010, stall_s=0.040)
    assert statistics.median(trial.lent_costs) == statistics.median(trial.own_costs) == 0.010
    assert trial.phase == "own" and "2.00x" in trial.reason, trial.reason


def test_the_whole_device_trial_lends_when_the_own_cores_win_on_the_mean_but_not_every_pair():
    """One own block far faster (a lucky block, or a batch that grew), the other two slower: the
    mean favours the own cores, the pairs do not; the default (the whole device) stays. Two of
    three is not enough either while the own cores are less than clearly (``clear_gain``) cheaper."""
    trial, now = LendingTrial(block=1, pairs=3, gain=0.95, prefer_lent=True), 0.0
    for lent, cost, running in ((True, 0.010, 1), (False, 0.002, 5), (True, 0.010, 5), (False, 0.011, 5),
                                (True, 0.010, 5), (False, 0.011, 5)):  # fmt: skip
        assert trial.want_lent(now) is lent
        trial.observe(lent, cost * running, running, now)  # the first pair: the batch grew between its blocks
    assert trial.phase == "lend" and "own cores faster in 1 of 3 pairs" in trial.reason and trial.paid == 1
    assert LendingTrial(prefer_lent=True).reason.startswith("no measurement yet: the whole device")
    trial, now = LendingTrial(block=1, pairs=3, gain=0.95, prefer_lent=True), 0.0
    for lent, cost in ((True, 0.010), (False, 0.009), (True, 0.010), (False, 0.009), (True, 0.010), (False, 0.0111)):
        trial.observe(lent, cost, 1, now)
    assert trial.phase == "lend" and "own cores faster in 2 of 3 pairs" in trial.reason  # own mean 0.94x


@pytest.mark.parametrize(
    "first_pair,phase",
    [
        (((0.0070, 6), (0.0030, 6)), "own"),  # 2.33x at an unchanged batch of 6: bailed out after one pair
        (((0.0070, 6), (0.0030, 9)), "trial"),  # the batch changed between the blocks: no verdict yet
        (((0.0050, 6), (0.0030, 6)), "trial"),  # 1.67x: within bail, the trial goes on
    ],
)
def test_the_whole_device_trial_bails_after_one_pair_clearly_slower_at_one_batch(first_pair, phase):
    """bursty2's tiny-a (2026-12-05): the whole device measured 2.39-5.45x the own cost in a burst,
    whose batch holds still for many iterations; 12 lent iterations of a 3-pair trial cost a burst
    of about 40 their share."""
    trial = LendingTrial(block=2, pairs=3, gain=0.95, prefer_lent=True)
    (lent_cost, lent_batch), (own_cost, own_batch) = first_pair
    for lent, cost, batch in ((True, lent_cost, lent_batch), (False, own_cost, own_batch)):
        for _ in range(2):
            assert trial.want_lent(0.0) is lent
            trial.observe(lent, cost * batch, batch, 0.0)
    assert trial.phase == phase, trial.reason
    if phase == "own":
        assert "at an unchanged batch of 6: bailed out: own cores for 10 s" in trial.reason
        assert trial.refused == 1 and not trial.want_lent(5.0) and trial.want_lent(10.0)  # back-off, then a new trial


@pytest.mark.parametrize(
    "own_costs,lent_costs,phase",
    [
        # bursty2's tiny-a (2026-12-05): the whole device 2.39x on the means, one noisy pair its way
        ((0.002, 0.002, 0.009), (0.0070, 0.0070, 0.0032), "own"),
        ((0.010, 0.010, 0.012), (0.0135, 0.0135, 0.0114), "own"),  # 1.20x, two pairs of three
        ((0.010, 0.010, 0.012), (0.0120, 0.0120, 0.0112), "lend"),  # 1.10x: not clearly, not every pair
        ((0.010, 0.013, 0.013), (0.0125, 0.0125, 0.0125), "lend"),  # 1.04x, one pair of three
        ((0.010, 0.010, 0.010), (0.0112, 0.0112, 0.0112), "own"),  # 1.12x in every pair (gain 0.95)
    ],
)
def test_the_whole_device_trial_keeps_own_cores_clearly_cheaper_on_most_pairs(own_costs, lent_costs, phase):
    trial = LendingTrial(block=1, pairs=3, gain=0.95, prefer_lent=True)
    for own_s, lent_s in zip(own_costs, lent_costs):
        trial.observe(True, lent_s, 1, 0.0)
        trial.observe(False, own_s, 1, 0.0)
    assert trial.phase == phase, trial.reason


@pytest.mark.parametrize("third_busy", [False, True])
def test_equal_costs_lend_the_whole_device_but_not_a_busy_siblings_neighbourhood(tmp_path, third_busy):
    """Same decode cost on own and lent cores: with every sibling idle the engine computes on the
    whole device from its first iteration, tries its own core for a block per pair and goes back
    (stock's configuration); with a sibling busy it tries both and keeps its own share (the static split)."""
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 3).close()
    ComputeBoard.open(path).publish(2, os.getpid(), third_busy, 0.0)
    whole = LendingTrial(block=2, pairs=2, prefer_lent=True)
    a = ComputeLender(ComputeBoard.open(path), 0, THREE, apply=lambda c: None,
                      trial=LendingTrial(block=2, pairs=2), whole=whole)  # fmt: skip
    t, cores = 100.0, []  # the siblings quiet (never busy) for more than quiet_s
    for _ in range(30):
        cores.append(a.step(True, t, decoded=2))
        t += 0.004
    if third_busy:
        assert a.trial.phase == "own" and a.trial.paid == 0, a.status()["lending"]
        assert (0, 1) in cores and cores[-1] == (0,)  # tried its idle neighbour's core, kept its own
        assert a.status()["lending"] == a.status()["lending_beside_busy_siblings"]
    else:
        assert cores[0] == (0, 1, 2) and cores[-1] == (0, 1, 2) and cores.count((0,)) <= 6  # two own blocks
        assert whole.phase == "lend" and whole.paid == 1 and a.trial.own_costs == a.trial.lent_costs == []
        assert a.status()["lending"] == a.status()["lending_whole_device"] and "whole device" in whole.reason


def test_a_model_too_small_for_two_threads_keeps_its_own_core_beside_idle_siblings(tmp_path):
    """Every sibling idle, but the whole device is 40 % slower per decode step (OpenMP barriers of
    a tiny model): after two pairs the engine stays on its own core for the back-off."""
    path = tmp_path / "pool.compute"
    ComputeBoard.create(path, 2).close()
    whole = LendingTrial(block=2, pairs=2, prefer_lent=True, hold_s=30.0)
    a = ComputeLender(ComputeBoard.open(path), 0, TWO, apply=lambda c: None, whole=whole)
    t, cores = 100.0, []
    for _ in range(24):
        cores.append(a.step(True, t, decoded=3))
        t += 0.0020 if cores[-1] == (0,) else 0.0028
    assert whole.phase == "own" and whole.refused == 1 and cores[-6:] == [(0,)] * 6
    assert t < whole.until <= t + 30.0  # own cores for the 30 s back-off from the verdict
    assert "1.40x" in a.status()["lending"]["reason"] and a.trial.trials == 1 and a.trial.own_costs == []


def test_the_trial_backs_off_doubling_and_retries_then_a_paying_trial_resets_it():
    trial = LendingTrial(block=1, pairs=1, hold_s=10.0, max_backoff_s=25.0)
    assert trial.want_lent(0.0) is False  # own first
    trial.observe(False, 0.01, 1, 0.0)
    assert trial.want_lent(0.0) is True
    trial.observe(True, 0.02, 1, 0.0)  # slower: own cores for 10 s
    assert trial.phase == "own" and not trial.want_lent(9.9) and trial.want_lent(10.0) is False  # new trial: own first
    assert trial.trials == 2
    trial.observe(False, 0.01, 1, 10.0)
    trial.observe(True, 0.02, 1, 10.0)  # slower again: 20 s
    assert trial.until == 30.0
    trial.want_lent(30.0)
    trial.observe(False, 0.01, 1, 30.0)
    trial.observe(True, 0.02, 1, 30.0)  # capped at 25 s
    assert trial.until == 55.0
    trial.want_lent(55.0)
    trial.observe(False, 0.01, 1, 55.0)
    trial.observe(True, 0.005, 1, 55.0)  # pays: lend for hold_s, back-off reset
    assert trial.phase == "lend" and trial.until == 65.0 and trial.backoff_s == 10.0
    assert trial.want_lent(64.0) is True and trial.want_lent(65.0) is False  # held, then measured again
    trial.observe(False, 0.01, 1, 65.0)
    trial.observe(True, 0.005, 1, 65.0)  # pays again: the hold doubles (the trial's own blocks get rarer)
    assert trial.until == 85.0 and trial.want_lent(84.0) is True
    trial.want_lent(85.0)
    trial.observe(False, 0.01, 1, 85.0)
    trial.observe(True, 0.02, 1, 85.0)  # stopped paying: own cores, and the hold starts again from hold_s
    assert trial.phase == "own" and trial.next_hold_s == 10.0


def test_bad_trial_parameters_name_the_field():
    from memory_ext.policy.lending_trial import LendingTrialError

    for kwargs, field in (({"block": 0}, "block"), ({"pairs": 1.5}, "pairs"), ({"gain": 0}, "gain"),
                          ({"hold_s": float("nan")}, "hold_s"), ({"bail": -1}, "bail"),
                          ({"clear_gain": -0.5}, "clear_gain")):  # fmt: skip
        with pytest.raises(LendingTrialError, match=f"^{field}:"):
            LendingTrial(**kwargs)
    with pytest.raises(LendingTrialError, match="^seconds:"):
        LendingTrial().observe(True, -1.0, 1, 0.0)
