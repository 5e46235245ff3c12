"""Peer KV tier (SwiftCache W1, W3, W4; D1): one server's prefix KV kept in memory that a
co-located server donates, instead of host memory.

Mechanisms, no sglang; the decisions are ``policy.swiftcache``'s, which ``controller`` applies.
One job per module:

* ``layout``      -- the borrower's block geometry (block-major: one block = all layers' K
  and V of ``block_tokens`` tokens, contiguous) and the compatibility check.
* ``generations`` -- the per-block generation counters, in a shared memfd the donor writes
  and borrowers read (seqlock validation of every read).
* ``region``      -- the donor's donated region: chunks owned as ``PEER_DONATION``, mapped
  block-major, grown / shrunk at the tail by whole elastic units (chunk moves, no copy).
* ``wire``        -- the donor <-> borrower messages (JSON packets, fds by SCM_RIGHTS).
* ``donor``       -- the donor's end: a Unix socket, one lease (region) per borrower,
  grow / reclaim, write fences, borrower death.
* ``link``        -- the borrower's end of one lease: maps the donor's chunks, copies
  blocks in and out, validates reads, drops everything when the donor goes away.
* ``copier``      -- how bytes move (host: ``copy_``; CUDA: peer copy + stream sync).
* ``index``       -- token-hash chain -> (peer, block, generation).
* ``tier``        -- the borrower's peer tier: links + index + block choice.
* ``kvpack``      -- layer-major KV buffers <-> block-major blocks.
* ``kvio``        -- spill / load a token path's pages between KV slots and the tier (what the
  server hooks will call).
* ``controller``  -- the donor's Alg. 1 loop (``policy.swiftcache.DonationPolicy``) over its leases.
* ``discovery``   -- where donors listen in the shared pool's directory.

See docs/peer-kv.md.
"""

from . import wire
from .controller import DonorController
from .copier import CudaPeerCopier, HostCopier, copier_for
from .discovery import donor_socket, donor_sockets
from .donor import PeerDonor
from .generations import GenerationTable
from .index import PrefixIndex, chain_hashes
from .kvio import PeerKVIO
from .layout import PeerKVLayout
from .link import BlockRef, PeerLink
from .lsc import LayerStreamCache, LayerStreamLost
from .region import DonatedRegion
from .tier import PeerKVTier

__all__ = [
    "BlockRef",
    "CudaPeerCopier",
    "DonatedRegion",
    "DonorController",
    "GenerationTable",
    "HostCopier",
    "LayerStreamCache",
    "LayerStreamLost",
    "PeerDonor",
    "PeerKVIO",
    "PeerKVLayout",
    "PeerKVTier",
    "PeerLink",
    "PrefixIndex",
    "chain_hashes",
    "copier_for",
    "donor_socket",
    "donor_sockets",
    "wire",
]
