"""The borrower's radix-cache logic (sglang_memx.peer.prefix): spill an evicted path, load its
continuation into new slots, insert, never leak a slot; against a real donor in this process,
upstream's own RadixKey / MatchResult / MatchPrefixParams, and a small fake tree and allocator."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey

from memory_ext.peer import PeerDonor, PeerKVIO, PeerKVTier
from memory_ext.peer.kvpack import layout_of_buffers
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend, private_dir
from sglang_memx.peer.prefix import PeerPrefixCache

G = 1 << 16
SLOTS, LAYERS, HEADS, DIM, T = 512, 2, 2, 8, 16


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


class FakeTree:
    """Paths stored whole (node id -> tokens, slots); enough of UnifiedRadixCache for the tier.
    ``insert`` follows upstream's duplicate rule (``unified_tree_core._insert_overlap_step``): the
    slots of ``value`` past ``prev_prefix_len`` for tokens the tree already holds are freed."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.nodes = {0: ([], torch.empty(0, dtype=torch.int64))}

    def path_device_indices(self, node):
        return self.nodes[node][1]

    def match(self, tokens):
        best = (0, 0)
        for nid, (toks, _) in self.nodes.items():
            n = 0
            while n < min(len(toks), len(tokens)) and toks[n] == tokens[n]:
                n += 1
            if n > best[0]:
                best = (n, nid)
        n, nid = best
        if n < len(self.nodes[nid][0]):  # split: a node for the matched part
            nid = self.add(self.nodes[nid][0][:n], self.nodes[nid][1][:n])
        return MatchResult(device_prefix_len=n, last_device_node=nid, last_host_node=nid, best_match_node=nid)

    def add(self, tokens, slots):
        nid = max(self.nodes) + 1
        self.nodes[nid] = (list(tokens), slots)
        return nid

    def insert(self, params):
        tokens = list(params.key.raw_token_ids())
        had, nid = self.match(tokens)[:2]
        if params.prev_prefix_len < had:  # duplicates of what the tree holds go back to the allocator
            self.alloc.free(params.value[params.prev_prefix_len : had])
        self.add(tokens, torch.cat([self.nodes[nid][1][:had], params.value[had:]]))

        class Result:
            prefix_len = had

        return Result()


class FakeAllocator:
    def __init__(self):
        self.free_slots = list(range(1, SLOTS))

    def available_size(self):
        return len(self.free_slots)

    def alloc(self, n):
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, idx):
        self.free_slots += [int(i) for i in idx]


@pytest.fixture
def setup(tmp_path):
    donor_vmm, borrower_vmm = host_backend(G), host_backend(G)
    pool = ChunkPool(donor_vmm, capacity_chunks=16)
    path = private_dir(tmp_path / "s") + "/d.sock"
    donor = PeerDonor(pool, path, max_bytes_per_lease=8 * G)
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
    tier = PeerKVTier(layout_of_buffers(k, v, T, model="m"))
    link = tier.connect(path, "b", borrower_vmm)
    lease = donor.wait_for_lease()
    donor.grow(lease, 4)
    wait_until(lambda: link.num_blocks > 0)
    alloc = FakeAllocator()
    tree = FakeTree(alloc)
    cache = PeerPrefixCache(tree, alloc, PeerKVIO(tier, k, v), SLOTS, Counter())
    yield cache, tree, alloc, k, v, donor, lease, link
    tier.close()
    donor.close()
    donor_vmm.close()
    borrower_vmm.close()


def assert_no_slot_both_free_and_cached(tree, alloc):
    """Every slot at most once in the allocator, and never both there and on a tree path."""
    free = [int(i) for i in alloc.free_slots]
    assert len(free) == len(set(free)), "a slot freed twice"
    cached = {int(i) for _, slots in tree.nodes.values() for i in slots}
    assert not cached & set(free), f"slots both cached and free: {sorted(cached & set(free))[:8]}"


def _request(tree, cache, tokens, extra_key=None):
    params = MatchPrefixParams(key=RadixKey(list(tokens), extra_key), req=object())
    return cache.load(params, tree.match(tokens), lambda: tree.match(tokens))


def _spill_and_evict(cache, tree, alloc, k, tokens):
    """A request's KV in ``tokens``' slots, inserted, then its leaf evicted (spilled first)."""
    slots = alloc.alloc(len(tokens))
    rows = [layer[slots].clone() for layer in k]
    cache.note_insert(RadixKey(list(tokens)), slots)
    leaf = tree.add(tokens, slots)
    cache.spill(leaf)
    del tree.nodes[leaf]
    alloc.free(slots)
    for layer in k:
        layer[slots] = 0  # the slots are reused: their old KV is gone
    return rows


def test_evicted_path_comes_back_into_new_slots_and_nothing_leaks(setup):
    cache, tree, alloc, k, v, *_ = setup
    tokens = list(range(1000, 1000 + 5 * T + 3))  # 5 full pages and 3 tokens more
    rows = _spill_and_evict(cache, tree, alloc, k, tokens)
    assert cache.stats["spills"] == 1 and cache.stats["pages_spilled"] == 5
    # the first 20 tokens are still on the device (another request's prefix)
    head = alloc.alloc(20)
    tree.add(tokens[:20], head)
    for layer, r in zip(k, rows):
        layer[head] = r[:20]
    free_before = alloc.available_size()
    again = _request(tree, cache, tokens + [7, 8, 9])
    assert again.device_prefix_len == 5 * T  # local 20 -> peer up to 80; the rest is recomputed
    path = tree.path_device_indices(again.last_device_node)
    assert torch.equal(path[:20], head)
    for layer, r in zip(k, rows):
        assert torch.equal(layer[path], r[: 5 * T])  # byte-identical KV for every token
    assert alloc.available_size() == free_before - (5 * T - 20)  # page 1's first 4 slots went back
    assert_no_slot_both_free_and_cached(tree, alloc)  # the 20 device slots were not freed by the insert
    assert cache.stats["hits"] == 1 and cache.stats["pages_loaded"] == 4 and cache.stats["tokens_loaded"] == 60
    # a second match finds it all on the device: nothing is read again
    assert _request(tree, cache, tokens).device_prefix_len == 5 * T and cache.stats["hits"] == 1


def test_tokens_the_tree_got_during_the_load_free_our_copies_once(setup, monkeypatch):
    """Another request inserts part of the continuation while the peer read runs: the insert
    keeps the tree's slots and frees our spare copies, exactly once (the soak's two replicas
    crashed on upstream's idle leak check when these and the device prefix were freed too)."""
    cache, tree, alloc, k, v, *_ = setup
    tokens = list(range(4000, 4000 + 5 * T))
    _spill_and_evict(cache, tree, alloc, k, tokens)
    head = alloc.alloc(20)
    tree.add(tokens[:20], head)
    real_load = cache.io.load
    theirs = {}

    def load(toks, first, slots):
        got = real_load(toks, first, slots)
        theirs["slots"] = torch.cat([head, alloc.alloc(48 - 20)])  # another request's KV for 48 tokens
        tree.add(tokens[:48], theirs["slots"])
        return got

    monkeypatch.setattr(cache.io, "load", load)
    total = alloc.available_size() + 20  # every slot not cached by the evicted path
    again = _request(tree, cache, tokens + [1])
    assert again.device_prefix_len == 5 * T
    path = tree.path_device_indices(again.last_device_node)
    assert torch.equal(path[:48], theirs["slots"])  # the tree's slots win
    assert_no_slot_both_free_and_cached(tree, alloc)
    in_path = len({int(i) for i in path})
    assert alloc.available_size() + in_path == total  # our 28 spare copies went back, nothing else


def test_a_page_lost_between_match_and_read_is_recomputed(setup, monkeypatch):
    cache, tree, alloc, k, v, donor, lease, link = setup
    tokens = list(range(2000, 2000 + 4 * T))
    rows = _spill_and_evict(cache, tree, alloc, k, tokens)
    reads = {"n": 0}
    real_read = link.read

    def read(ref, dst):  # the third page is reclaimed after the match, before its read
        reads["n"] += 1
        return False if reads["n"] == 3 else real_read(ref, dst)

    monkeypatch.setattr(link, "read", read)
    free_before = alloc.available_size()
    again = _request(tree, cache, tokens + [1])
    assert again.device_prefix_len == 2 * T
    path = tree.path_device_indices(again.last_device_node)
    for layer, r in zip(k, rows):
        assert torch.equal(layer[path], r[: 2 * T])
    assert alloc.available_size() == free_before - 2 * T  # the two unread pages' slots went back
    assert cache.stats["recomputes_after_reclaim"] == 1


def test_reclaimed_donation_is_a_miss_and_namespaced_paths_are_not_spilled(setup):
    cache, tree, alloc, k, v, donor, lease, link = setup
    tokens = list(range(3000, 3000 + 3 * T))
    _spill_and_evict(cache, tree, alloc, k, tokens)
    wait_until(lambda: all(le["fences"] == 0 for le in donor.status()["leases"]))
    donor.reclaim(lease, 4)
    wait_until(lambda: link.num_blocks == 0)
    free_before = alloc.available_size()
    miss = _request(tree, cache, tokens)
    assert miss.device_prefix_len == 0 and alloc.available_size() == free_before
    assert cache.stats["lookups_missed"] == 1 and cache.stats["hits"] == 0
    donor.grow(lease, 2)
    wait_until(lambda: link.num_blocks > 0)
    slots = alloc.alloc(2 * T)
    cache.note_insert(RadixKey(list(range(2 * T)), "lora-a"), slots)
    cache.spill(tree.add(list(range(2 * T)), slots))
    assert cache.stats["spills_skipped_namespace"] == 1 and cache.io.tier.status()["pages"] == 0
