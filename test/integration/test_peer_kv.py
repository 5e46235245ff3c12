"""The peer KV tier in real SGLang servers on CPU (docs/peer-kv.md): a donor and a borrower on one
shared pool, and a stock server as the reference.

The borrower's KV is small (512 tokens), so six 160-token conversations evict each other: their
prefixes are spilled into the donor's donated region and, when a conversation comes back, loaded
from there instead of recomputed. Checked: greedy outputs equal the stock server's; the
borrower's status shows spills and peer hits; the donor reclaims its donation when its own load
needs it, with no failed request and identical outputs; after a SIGKILL of the donor the borrower
keeps serving identical outputs and the arbiter's books balance (held + free + uncreated = budget).
"""

import os
import random
import signal
import threading
import time

import pytest

from memory_ext.pool.arbiter_client import query_arbiter_status
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import SGLangServer, release_with_pool, start_all

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1200),
]

# test_kv_slab.py's model A, with the same arguments: its stock server is the session's (started once)
SPEC = TinyModelSpec(arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
# float32: the servers see different batch shapes; bf16 rounding could flip a flat random model's argmax
COMMON = ["--chunked-prefill-size", "64", "--dtype", "float32"]
# 512 B of KV a token (2 layers x K,V x 2 heads x 16 x 4 B): a 64 KiB chunk holds 8 peer blocks of 16 tokens.
# The donor lends at most 512 KiB (64 blocks, 1024 tokens) of its 2048-token KV capacity: a load of more
# than the other 1024 tokens makes it reclaim.
DONATE_GB = "0.00048828125"
CONVS, PREFIX, MORE, NEW = 6, 160, 48, 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_root, shared_servers):
    model = tiny_model(SPEC, tiny_model_root)
    pool_dir = tmp_path_factory.mktemp("pools")
    name = f"pk{os.getpid()}"
    pool = ["--memx-elastic-kv", "--memx-pool", name, "--memx-pool-budget-gb", "0.02", "--memx-pool-dir",
            str(pool_dir)]  # fmt: skip
    donor = DumpingServer(model, name="peer-donor", max_total_tokens=2048,
                         extra_args=COMMON + pool + ["--memx-peer-kv", "donate", "--memx-peer-donate-max-gb",
                                                     DONATE_GB])  # fmt: skip
    borrower = DumpingServer(model, name="peer-borrower", max_total_tokens=512,
                            extra_args=COMMON + pool + ["--memx-peer-kv", "borrow"])  # fmt: skip
    stock = shared_servers.get(
        SGLangServer(model, name="stock-llama-s5-f32-c64", stock=True, max_total_tokens=4096, extra_args=COMMON)
    )
    try:
        start_all([donor, borrower, stock])
        donor.dump_on_stop = borrower.dump_on_stop = False
        yield {"donor": donor, "borrower": borrower, "stock": stock, "sock": pool_dir / f"{name}.sock"}
    finally:  # the pool's arbiter outlives its servers: stop it even when they never became healthy
        release_with_pool([donor, borrower, stock], name, pool_dir)  # the shared stock server stays up


class DumpingServer(SGLangServer):
    """Stopped during start-up (not healthy in time): its scheduler is SIGABRTed first. Upstream
    enables faulthandler there, so every thread's Python stack lands in test-logs/<name>.log."""

    dump_on_stop = True

    def stop(self):
        if self.dump_on_stop and self.proc is not None:
            _dump_scheduler_stacks([self])
        super().stop()


def _dump_scheduler_stacks(servers):
    for server in servers:
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().split()
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
            except (OSError, ValueError):
                continue
            if fields[3] == str(server.proc.pid) and comm.startswith("sglang::sched"):
                os.kill(int(pid), signal.SIGABRT)
    time.sleep(3)


def _gen(server, ids, n=NEW):
    out = server.request(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    )
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def _peer(server):
    return server.request("/memx/status")["schedulers"][0]["peer_kv"]


def _wait(cond, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not reached in {timeout} s"
        time.sleep(0.2)


rng = random.Random(11)
PREFIXES = [[rng.randrange(3, SPEC.vocab_size) for _ in range(PREFIX)] for _ in range(CONVS)]
TURN2 = [p + [rng.randrange(3, SPEC.vocab_size) for _ in range(MORE)] for p in PREFIXES]
TURN3 = [p + [rng.randrange(3, SPEC.vocab_size) for _ in range(MORE)] for p in PREFIXES]


def _turns(server, turn):
    return [_gen(server, ids) for ids in turn]  # one at a time: the borrower's 512 tokens hold three


def test_evicted_prefixes_come_back_from_the_donor(servers):
    borrower, donor, stock = servers["borrower"], servers["donor"], servers["stock"]
    _wait(lambda: _peer(borrower)["borrower"]["borrowed_bytes"] > 0, what="a donation reaching the borrower")
    want1, want2 = _turns(stock, PREFIXES), _turns(stock, TURN2)
    assert _turns(borrower, PREFIXES) == want1
    assert _turns(borrower, TURN2) == want2
    st = _peer(borrower)
    print("borrower peer_kv:", st)
    print("donor peer_kv:", _peer(donor))
    b = st["borrower"]
    assert st["spills"] > 0 and b["pages_stored"] > 0
    assert st["hits"] > 0 and b["pages_hit"] > 0 and st["tokens_loaded"] >= 16
    [peer] = b["peers"]
    assert peer["borrowed_bytes"] > 0
    assert _peer(donor)["donor"]["donated_bytes"] == peer["borrowed_bytes"]
    metrics = borrower.request_text("/memx/metrics")
    assert "memx_peer_kv_hits_total" in metrics and "memx_peer_kv_borrowed_bytes" in metrics


def test_donor_reclaims_under_load_without_failing_a_request(servers):
    borrower, donor, stock = servers["borrower"], servers["donor"], servers["stock"]
    # the donor lends its whole cap first (a young donor may still lend less), so that its own
    # load (one 1,100-token prompt + 16 new > the 1,024 tokens it keeps) must reclaim; one
    # request, so its batches, and hence its float32 outputs, are the stock server's
    _wait(lambda: _peer(donor)["donor"]["donated_bytes"] >= _peer(donor)["donor"]["cap_bytes"], timeout=180,
          what="the donor lending its whole cap")  # fmt: skip
    before = _peer(donor)
    long_ids = [[rng.randrange(3, SPEC.vocab_size) for _ in range(1100)]]
    errors, got = [], {}

    def donor_load():
        try:
            got["donor"] = _gen(donor, long_ids, 16)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=donor_load)
    t.start()
    out = _turns(borrower, TURN3)
    t.join(300)
    assert not errors and got["donor"] == _gen(stock, long_ids, 16)
    assert out == _turns(stock, TURN3)
    after = _peer(donor)
    print("donor peer_kv after its load:", after, "\nborrower:", _peer(borrower))
    assert after.get("reclaims", 0) > before.get("reclaims", 0) and after["reclaimed_chunks"] > 0
    # below its cap, its load inside the policy's 60 s window: no decision to donate, so nothing is
    # asked of the arbiter (a borrow before the decision was asked every 0.5 s, then given back);
    # first, what its load left warm goes back once its hold ends (one return, not a cycle)
    _wait(lambda: _shared_pool(donor)["warm_chunks"] == 0, timeout=30, what="the donor's warm chunks going back")
    asked = _pool_asks(donor)
    time.sleep(3.0)  # six donation ticks
    assert _pool_asks(donor) == asked
    assert _turns(borrower, TURN2) == _turns(stock, TURN2)  # still identical after the reclaim


def _shared_pool(server) -> dict:
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["shared_pool"]


def _pool_asks(server):
    """What the server asked of the pool's arbiter so far: chunks borrowed, borrows denied, chunks returned."""
    pool = _shared_pool(server)
    return pool["borrowed_total"], pool["denied_total"], pool["returned_total"]


def test_donor_killed_borrower_keeps_serving(servers):
    borrower, donor, stock = servers["borrower"], servers["donor"], servers["stock"]
    assert _peer(borrower)["borrower"]["peers"]  # still linked to the donor
    pid = donor.request("/memx/status")["schedulers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    out = _turns(borrower, TURN2)
    assert out == _turns(stock, TURN2)
    _wait(lambda: not _peer(borrower)["borrower"]["peers"], what="the borrower dropping the dead donor")
    assert _peer(borrower)["borrower"]["donors_lost"] == 1

    def balanced():
        st = query_arbiter_status(servers["sock"])
        return pid not in {c["pid"] for c in st["clients"]} and st

    _wait(balanced, what="the arbiter taking the dead donor's chunks back")
    st = query_arbiter_status(servers["sock"])
    held = sum(c["held"] for c in st["clients"])
    assert held + st["free"] + (st["budget"] - st["created"]) == st["budget"], st
