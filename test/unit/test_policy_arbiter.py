"""Node-wide memory arbiter (X1): hand-worked grants, the priority rule, and
conservation of every GPU's budget."""

import random

import pytest

from memory_ext.policy.arbiter import DEFAULT_TIERS, AccountKey, Kind, MemoryArbiter, PriorityViolation, Take, Tier


def _node():
    """GPU 0, budget 1000 bytes. Model A: weights 300 (one layer = 100 kept),
    activation 50 (unit 10), KV 200 (block 10). Model B: weights 200 (floor
    50), KV 200 (block 20). Free: 1000 - 950 = 50."""
    arb = MemoryArbiter({0: 1000}, floor_fraction=0.25)
    k = {
        "aw": arb.open(0, "A", "weights", 300, floor=100),
        "aa": arb.open(0, "A", "activation", 50, unit=10),
        "ak": arb.open(0, "A", "kv", 200, unit=10),
        "bw": arb.open(0, "B", "weights", 200, floor=50),
        "bk": arb.open(0, "B", "kv", 200, unit=20),
    }
    return arb, k


def test_open_takes_from_the_budget():
    arb, k = _node()
    assert arb.free[0] == 50 and arb.allocated(0) == 950
    assert arb.nominal(0, "A") == 550 and arb.excess(0, "A") == 0
    with pytest.raises(ValueError, match="held"):
        arb.open(0, "C", "kv", 51)
    with pytest.raises(ValueError, match="already open"):
        arb.open(0, "A", "kv", 1)
    arb.check()


def test_free_first_then_idle_peer_down_to_its_floor():
    arb, k = _node()
    arb.set_busy(0, "A", True)
    arb.set_busy(0, "B", False)
    arb.report(k["bk"], 200)  # B is idle, all its KV free
    g = arb.request(k["ak"], 120)
    # free 50; B may keep ceil(0.25*200 = 50 -> 60, its unit 20); lendable 140;
    # A still needs 70 -> one take of ceil(70/20)*20 = 80; pool 130 -> grant 120
    assert g.granted == 120 and g.shortfall == 0
    assert g.takes == (Take(None, 50, Tier.FREE), Take(k["bk"], 80, Tier.IDLE_PEER))
    assert arb.held(k["ak"]) == 320 and arb.held(k["bk"]) == 120
    assert arb.free[0] == 10  # 50 + 80 - 120: the rounding surplus stays free
    assert arb.excess(0, "A") == 120 and arb.excess(0, "B") == -80
    arb.check()


def test_borrowed_idle_memory_returns_first_and_busy_peers_are_never_taken():
    arb, k = _node()
    arb.set_busy(0, "A", True)
    arb.report(k["bk"], 200)
    arb.request(k["ak"], 120)  # as above: A holds 120 of B's / free memory
    arb.set_busy(0, "B", True)  # B wakes up and needs KV again
    arb.report(k["ak"], 50)  # A uses 270 of its 320
    g = arb.request(k["bk"], 100)
    # free 10; RETURN from A: min(idle 50, excess 120) = 50; A is busy: no IDLE_PEER.
    # pool 60 -> 60 granted (3 blocks of 20), partial
    assert g.granted == 60 and g.shortfall == 40
    assert g.takes == (Take(None, 10, Tier.FREE), Take(k["ak"], 50, Tier.RETURN))
    assert arb.held(k["ak"]) == 270 and arb.held(k["bk"]) == 180 and arb.free[0] == 0
    # nothing idle anywhere now: refused, and a refusal changes nothing
    g = arb.request(k["bk"], 20)
    assert g.granted == 0 and g.takes == () and "refused" in g.reason
    assert arb.held(k["bk"]) == 180 and arb.refused == 1
    arb.check()


def test_busy_peers_lend_only_their_reported_surplus_after_idle_peers():
    arb, k = _node()
    arb.set_busy(0, "A", True)
    arb.set_busy(0, "B", True)
    arb.report(k["bk"], 100)  # B has work; the engine reports its free KV beyond B's own headroom
    g = arb.request(k["ak"], 120, tiers=(Tier.FREE, Tier.RETURN, Tier.IDLE_PEER))
    assert g.granted == 50  # busy B is not an idle peer
    arb.report(k["bk"], 100)
    g = arb.request(k["ak"], 70)
    # SURPLUS: min(idle 100, held 200 - floor 60) = 100; take ceil(70/20)*20 = 80, 10 left free
    assert g.granted == 70 and g.takes == (Take(k["bk"], 80, Tier.SURPLUS),)
    assert arb.free[0] == 10 and arb.held(k["bk"]) == 120
    arb.report(k["bk"], 120)
    # never below the floor: B keeps ceil(0.25*200) -> 60 bytes
    assert arb.request(k["ak"], 1000).granted == 10 + 60
    arb.check()


def test_release_gives_back_to_free():
    arb, k = _node()
    arb.release(k["aw"], 150)
    assert arb.free[0] == 200 and arb.held(k["aw"]) == 150
    with pytest.raises(ValueError, match="floor"):
        arb.release(k["aw"], 51)
    with pytest.raises(ValueError, match="idle"):
        arb.release(k["ak"], 10)


def test_idle_means_reported_idle_never_memory_in_use():
    arb, k = _node()
    arb.set_busy(0, "B", False)
    arb.report(k["bk"], 0)  # B idle but its KV is full of blocks in use (e.g. being swapped)
    g = arb.request(k["ak"], 200)
    assert g.granted == 50 and g.takes == (Take(None, 50, Tier.FREE),)
    arb.report(k["ak"], 40)
    with pytest.raises(ValueError, match="idle"):
        arb.move(k["ak"], k["aa"], 50, Tier.OWN)  # eLLM deflation beyond idle KV
    with pytest.raises(ValueError, match="idle"):
        arb.report(k["bk"], 201)


def test_all_or_nothing_request():
    arb, k = _node()
    g = arb.request(k["ak"], 60, partial=False)
    assert g.granted == 0 and arb.free[0] == 50
    g = arb.request(k["ak"], 50, partial=False)
    assert g.granted == 50 and arb.free[0] == 0


def test_ellm_inflation_and_deflation_stay_inside_one_model():
    arb, k = _node()
    arb.report(k["aa"], 50)
    g = arb.move(k["aa"], k["ak"], 30, Tier.OWN)  # inflate 3 chunks
    assert g.granted == 30 and arb.held(k["aa"]) == 20 and arb.held(k["ak"]) == 230
    assert arb.excess(0, "A") == 0  # own memory: nobody's to return
    arb.report(k["ak"], 100)
    arb.move(k["ak"], k["aa"], 50, Tier.OWN)  # deflate beyond what was lent: allowed (own idle KV)
    assert arb.held(k["aa"]) == 70 and arb.held(k["ak"]) == 180
    with pytest.raises(ValueError, match="one model"):
        arb.move(k["aa"], k["bk"], 10, Tier.OWN)
    with pytest.raises(ValueError, match="multiple"):
        arb.move(k["ak"], k["aa"], 15, Tier.OWN)
    arb.check()


def test_remap_only_after_idle_memory_is_exhausted():
    arb, k = _node()
    arb.set_busy(0, "A", False)
    arb.set_busy(0, "B", True)
    arb.report(k["ak"], 200)
    # B is short; one layer of A is 100 bytes. Idle memory must go first:
    with pytest.raises(PriorityViolation):
        arb.move(k["aw"], k["bk"], 100, Tier.REMAP)
    g = arb.request(k["bk"], 400)  # free 50 + A's idle KV down to ceil(50, 10) = 50 -> 150
    assert g.granted == 200 and arb.held(k["ak"]) == 50 and arb.free[0] == 0
    assert g.takes == (Take(None, 50, Tier.FREE), Take(k["ak"], 150, Tier.IDLE_PEER))
    # one layer of A: B receives floor(100 / 20) * 20 = 100
    g = arb.move(k["aw"], k["bk"], 100, Tier.REMAP)
    assert g.granted == 100 and arb.held(k["aw"]) == 200 and arb.held(k["bk"]) == 500
    arb.move(k["aw"], k["bk"], 100, Tier.REMAP)
    with pytest.raises(ValueError, match="floor"):  # never a whole model: one layer stays
        arb.move(k["aw"], k["bk"], 100, Tier.REMAP)
    with pytest.raises(ValueError, match="own KV"):
        arb.move(k["aw"], k["ak"], 100, Tier.REMAP)
    arb.check()


def test_never_remaps_weights_of_a_busy_model_nor_into_a_lender():
    arb, k = _node()
    arb.set_busy(0, "B", True)
    arb.report(k["ak"], 0)  # A is idle but its KV holds cached blocks nobody may evict here
    assert arb.request(k["bk"], 50).granted == 40  # free 50 -> 2 blocks of 20; 10 left < one block
    arb.set_busy(0, "A", True)  # A's weights are read every iteration now
    with pytest.raises(PriorityViolation, match="has work"):
        arb.move(k["aw"], k["bk"], 100, Tier.REMAP)
    arb.set_busy(0, "A", False)
    arb.move(k["aw"], k["bk"], 100, Tier.REMAP)  # A idle: one layer of A into B
    # A wakes up short of KV while B goes idle: B's weights may not go to A,
    # which first gets its own layer back (no mutual lending)
    arb.set_busy(0, "A", True)
    arb.set_busy(0, "B", False)
    arb.report(k["bk"], 0)
    with pytest.raises(PriorityViolation, match="own weights"):
        arb.move(k["bw"], k["ak"], 100, Tier.REMAP)
    arb.check()


def test_restore_takes_back_only_idle_borrowed_memory_all_or_nothing():
    arb, k = _node()
    arb.set_busy(0, "A", False)
    arb.set_busy(0, "B", True)
    arb.report(k["ak"], 200)
    arb.request(k["bk"], 400)
    arb.move(k["aw"], k["bk"], 100, Tier.REMAP)  # B: 500, excess 300; A: weights 200
    # A wakes up and wants its layer back; B uses all but 80 bytes
    arb.set_busy(0, "A", True)
    arb.report(k["bk"], 80)
    g = arb.request(k["aw"], 100, partial=False, tiers=(Tier.FREE, Tier.RETURN))
    assert g.granted == 0 and arb.held(k["aw"]) == 200
    arb.report(k["bk"], 120)
    g = arb.request(k["aw"], 100, partial=False, tiers=(Tier.FREE, Tier.RETURN))
    # B's unit is 20: 100 bytes = 5 blocks taken, exactly one layer back
    assert g.granted == 100 and g.takes == (Take(k["bk"], 100, Tier.RETURN),)
    assert arb.held(k["aw"]) == 300 and arb.held(k["bk"]) == 400
    arb.check()


def test_select_n_offload_keeps_a_layer():
    arb, k = _node()
    g = arb.move(k["bw"], k["bk"], 130, Tier.OFFLOAD)  # 130 bytes freed -> 6 blocks of 20, 10 to free
    assert g.granted == 120 and arb.free[0] == 60 and arb.held(k["bw"]) == 70
    with pytest.raises(ValueError, match="floor"):
        arb.move(k["bw"], k["bk"], 21, Tier.OFFLOAD)
    with pytest.raises(ValueError, match="one model"):
        arb.move(k["bw"], k["ak"], 10, Tier.OFFLOAD)


def test_swiftcache_lend_and_reclaim_across_gpus():
    """Worker W on GPU 1 lends idle KV to master M (GPU 0): the memory stays in
    GPU 1's budget, in M's peer account there."""
    arb = MemoryArbiter({0: 500, 1: 500})
    mk = arb.open(0, "M", "kv", 400, unit=8)
    wk = arb.open(1, "W", "kv", 480, unit=16)
    peer = arb.open(1, "M", "peer", 0, unit=16)
    arb.report(wk, 320)
    with pytest.raises(ValueError, match="different GPUs"):
        arb.move(wk, mk, 16, Tier.LEND)
    g = arb.move(wk, peer, 320, Tier.LEND)
    assert g.granted == 320 and arb.held(wk) == 160 and arb.allocated(1) == 480
    # the master's peer memory is not KV: no request can take it, only RECLAIM
    arb.set_busy(1, "W", True)
    assert arb.request(wk, 16).granted == 16  # from GPU 1's free 20
    assert arb.request(wk, 16).granted == 0
    g = arb.move(peer, wk, 160, Tier.RECLAIM)
    assert arb.held(peer) == 160 and arb.held(wk) == 336
    with pytest.raises(ValueError, match="cannot move"):
        arb.move(wk, wk, 16, Tier.LEND)
    arb.check()


def test_tiers_of_the_node():
    arb = MemoryArbiter({0: 100}, tiers=(Tier.FREE, Tier.RETURN))
    a = arb.open(0, "A", "kv", 40, unit=10)
    b = arb.open(0, "B", "kv", 60, unit=10)
    arb.open(0, "B", "weights", 0)
    arb.report(a, 40)
    assert arb.grantable(b) == 0  # A is idle, but IDLE_PEER is off on this node
    assert arb.request(b, 10).granted == 0
    assert arb.grantable(b, DEFAULT_TIERS) == 30
    arb.set_busy(0, "A", True)
    assert arb.grantable(b, DEFAULT_TIERS) == 30  # the same idle bytes, now as SURPLUS
    with pytest.raises(ValueError, match="tiers"):
        arb.request(b, 10, tiers=("remap",))
    with pytest.raises(ValueError, match="tiers"):
        MemoryArbiter({0: 1}, tiers=("nope",))


def test_random_operations_conserve_every_budget():
    """Seeded random mix of requests and moves (invalid ones raise and change
    nothing): after every step free + held == budget, free >= 0, peak <= budget."""
    rng = random.Random(7)
    budgets = {0: 10_000, 1: 8_000}
    arb = MemoryArbiter(budgets)
    keys = []
    for g, owners in ((0, "ABC"), (1, "DE")):
        for o in owners:
            keys.append(arb.open(g, o, "weights", 1000, floor=250))
            keys.append(arb.open(g, o, "activation", 300, unit=rng.choice((8, 16))))
            keys.append(arb.open(g, o, "kv", 1200, unit=rng.choice((8, 16, 32))))
    keys.append(arb.open(1, "A", "peer", 0, unit=16))
    before = {g: arb.allocated(g) for g in budgets}
    assert all(before[g] <= budgets[g] for g in budgets)
    tiers = list(Tier)
    shapes = {
        Tier.OWN: [(Kind.ACTIVATION, Kind.KV), (Kind.KV, Kind.ACTIVATION)],
        Tier.OFFLOAD: [(Kind.WEIGHTS, Kind.KV)],
        Tier.REMAP: [(Kind.WEIGHTS, Kind.KV)],
        Tier.LEND: [(Kind.KV, Kind.PEER)],
        Tier.RECLAIM: [(Kind.PEER, Kind.KV)],
    }
    for _ in range(3000):
        for key in keys:
            if key.kind in (Kind.KV, Kind.ACTIVATION):
                arb.report(key, rng.randint(0, arb.held(key)))
        for g, owners in ((0, "ABC"), (1, "DE")):
            for o in owners:
                arb.set_busy(g, o, rng.random() < 0.5)
        snapshot = ({k: (a.held, a.idle) for k, a in arb.accounts.items()}, dict(arb.free))
        try:
            if rng.random() < 0.5:
                arb.request(rng.choice(keys), rng.randint(1, 2000), partial=rng.random() < 0.7)
            else:
                tier = rng.choice(tiers)
                src, dst = rng.choice(keys), rng.choice(keys)
                if tier in shapes and rng.random() < 0.8:  # mostly well-formed moves
                    sk, dk = rng.choice(shapes[tier])
                    src = rng.choice([x for x in keys if x.kind is sk])
                    dst = rng.choice([x for x in keys if x.kind is dk and x.gpu == src.gpu] or [dst])
                arb.move(src, dst, rng.randint(1, 50) * rng.choice((1, 8, 16)), tier)
        except ValueError:
            assert ({k: (a.held, a.idle) for k, a in arb.accounts.items()}, dict(arb.free)) == snapshot
        for g, b in budgets.items():
            held = sum(a.held for a in arb.accounts.values() if a.key.gpu == g)
            assert held + arb.free[g] == b and arb.free[g] >= 0
            assert arb.peak[g] <= b
    arb.check()
    assert all(arb.events[t] > 0 for t in Tier), arb.events


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="budgets"):
        MemoryArbiter({})
    with pytest.raises(ValueError, match="floor_fraction"):
        MemoryArbiter({0: 1}, floor_fraction=1.5)
    arb = MemoryArbiter({0: 10})
    with pytest.raises(ValueError, match="kind"):
        arb.open(0, "A", "cache", 1)
    with pytest.raises(ValueError, match="gpu"):
        arb.open(3, "A", "kv", 1)
    k = arb.open(0, "A", "kv", 5)
    with pytest.raises(ValueError, match="nbytes"):
        arb.request(k, 0)
    with pytest.raises(ValueError, match="no account"):
        arb.request(AccountKey(0, "Z", Kind.KV), 1)
    with pytest.raises(ValueError, match="busy"):
        arb.set_busy(0, "A", 1)
