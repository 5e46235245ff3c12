"""Two rules that keep a shared-pool server admitting a burst as stock does: upstream's closed
admission opens again when the waiting head fits (``iteration.reopen_admission_when_head_fits``),
and an activation takes memory nobody on the device holds before it deflates KV that upstream's
admission has just counted (``ballooning.reserve_activation``)."""

import types

import pytest
from test_elastic_kv_controller import CHUNK, _make

from memory_ext.pool import Owner


def _req(prompt, max_new, output=0):
    params = types.SimpleNamespace(max_new_tokens=max_new, ignore_eos=False)
    return types.SimpleNamespace(origin_input_ids=[1] * prompt, output_ids=[2] * output, sampling_params=params)


def _scheduler(waiting, running=(), closed=True, slots=10, ratio=0.5):
    return types.SimpleNamespace(
        running_batch=types.SimpleNamespace(reqs=list(running), batch_is_full=closed),
        waiting_queue=list(waiting), get_num_allocatable_reqs=lambda n: slots,
        new_token_ratio_tracker=types.SimpleNamespace(current=ratio),
    )  # fmt: skip


class _Tree:
    def __init__(self, evictable):
        self.evictable = evictable

    def evictable_size(self):
        return self.evictable


@pytest.mark.parametrize(
    "case, waiting, running, closed, slots, evictable, reopened",
    [
        # 127 tokens free (two groups of 64 mapped, page 0 never allocatable)
        ("the head fits: reopened", [_req(100, 20)], [], True, 10, 0, True),
        ("exactly the room: upstream's check is strict, still closed", [_req(106, 20)], [], True, 10, 0, False),
        ("the running requests' decode reserve leaves too little", [_req(100, 20)], [_req(50, 80)], True, 10, 0, False),
        ("... but cached prefixes can be evicted for it", [_req(100, 20)], [_req(50, 80)], True, 10, 60, True),
        ("admission is open: nothing to do", [_req(100, 20)], [], False, 10, 0, False),
        ("closed by the request limit, not memory: left closed", [_req(10, 5)], [], True, 0, 0, False),
        ("nothing waits", [], [], True, 10, 0, False),
        ("the head does not fit: do nothing (no pass per iteration)", [_req(300, 20)], [], True, 10, 0, False),
    ],
)
def test_closed_admission_reopens_only_when_the_head_fits(case, waiting, running, closed, slots, evictable, reopened):
    from sglang_memx.elastic.iteration import reopen_admission_when_head_fits

    kv, alloc, _, _ = _make(1)
    kv.grow(alloc, 127)  # groups 0 and 1 mapped, all free
    sched = _scheduler(waiting, running, closed, slots)
    assert reopen_admission_when_head_fits(kv, sched, alloc, _Tree(evictable)) is reopened, case
    assert sched.running_batch.batch_is_full is (closed and not reopened), case
    assert kv.stats["admission_reopened"] == int(reopened), case


class _GrantingLent:
    """Plays LentPool: every borrow is granted with fresh chunks of the pool's backend."""

    def __init__(self, pool, backend):
        self.pool, self.backend, self.asked = pool, backend, []
        self.outstanding, self.last_denied_available = False, 0
        self.ranks, self.borrows_paused, self.BACKS_OFF_ALONE = 1, False, True

    def note_fell_short(self):
        pass

    def available_now(self):
        return 1 << 10

    def borrow(self, n, wait=None):
        self.asked.append(n)
        self.pool.adopt([self.backend.create_chunk() for _ in range(n)])
        return n


def _mapped_and_idle(borrow_room=0):
    """Every group mapped and free (KV that admission counts), no FREE chunk left."""
    from memory_ext.policy.activation import ActivationProfile
    from memory_ext.pool.activation_balloon import ActivationBalloon

    kv, alloc, pool, backend = _make(1, capacity_chunks=4 * 4, borrow_room=borrow_room)
    kv.activation = ActivationBalloon(pool, ActivationProfile(per_token_bytes=CHUNK))
    kv.grow(alloc, 63 + 3 * 64)
    assert pool.available() == 0 and kv.buffers.num_mapped == 4
    return kv, alloc, pool, backend


def test_an_activation_borrows_the_devices_free_memory_before_deflating_counted_kv():
    from sglang_memx.elastic.ballooning import reserve_activation

    kv, alloc, pool, backend = _mapped_and_idle(borrow_room=8)
    lent = _GrantingLent(pool, backend)
    free_before = len(alloc.free_pages)
    assert reserve_activation(kv, kv.activation, alloc, None, tokens=5, seqs=1, lent=lent)
    assert lent.asked == [5] and pool.usage()[Owner.ACTIVATION] == 5
    assert kv.buffers.num_mapped == 4 and len(alloc.free_pages) == free_before  # no KV group deflated
    kv.check(alloc)


def test_an_own_pool_still_deflates_idle_kv_for_its_activation():
    from sglang_memx.elastic.ballooning import reserve_activation

    kv, alloc, pool, _ = _mapped_and_idle()
    assert reserve_activation(kv, kv.activation, alloc, None, tokens=5, seqs=1, lent=None)
    assert kv.buffers.num_mapped < 4 and pool.usage()[Owner.ACTIVATION] == 5
    kv.check(alloc)
