"""Donor sockets in the pool directory (memory_ext.peer.discovery)."""

import os

import pytest

from memory_ext.peer import PeerDonor, donor_socket, donor_sockets
from memory_ext.pool import ChunkPool
from memory_ext.vmm import host_backend, private_dir


def test_donors_of_one_pool_are_found_and_only_them(tmp_path):
    d = private_dir(tmp_path / "pools")
    vmm = host_backend(1 << 16)
    pool = ChunkPool(vmm, capacity_chunks=4)
    donors = [
        PeerDonor(pool, donor_socket(d, "p1", "a"), max_bytes_per_lease=1 << 16),
        PeerDonor(pool, donor_socket(d, "p1", "b.2"), max_bytes_per_lease=1 << 16),
        PeerDonor(pool, donor_socket(d, "p2", "a"), max_bytes_per_lease=1 << 16),
    ]
    open(os.path.join(d, "p1.peer.c.sock"), "w").close()  # a regular file is not a donor
    try:
        assert donor_sockets(d, "p1") == {"a": f"{d}/p1.peer.a.sock", "b.2": f"{d}/p1.peer.b.2.sock"}
        assert list(donor_sockets(d, "p1", exclude="a")) == ["b.2"]
        assert list(donor_sockets(d, "p2")) == ["a"]
        assert donor_sockets(tmp_path / "missing", "p1") == {}
    finally:
        for donor in donors:
            donor.close()
        vmm.close()
    assert donor_sockets(d, "p1") == {}  # closing removes the socket file


@pytest.mark.parametrize(
    ("pool", "donor", "field"),
    [("../x", "a", "pool"), ("p", "a/b", "donor"), ("p", "x.peer.y", "donor"), ("p", "", "donor")],
)
def test_names_cannot_leave_the_directory(pool, donor, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        donor_socket("/tmp", pool, donor)
