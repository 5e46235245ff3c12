"""Parse-time checks of ``--memx-peer-kv`` against upstream's own flags (exit status 2, naming the flag).

The tier spills from and loads into upstream's device radix cache, on the CPU host link only
(the CUDA link is written and unit-level, never run in a server), and it sits before HiCache's
host tier, which it cannot yet share the tree with.
"""

from __future__ import annotations

from sglang_memx.config import MemxConfig, MemxConfigError


def check_peer_kv(config: MemxConfig, *, disable_radix_cache: bool, hierarchical_cache: bool, device) -> None:
    if config.disabled or config.peer_kv == "off":
        return
    if disable_radix_cache:
        raise MemxConfigError("--memx-peer-kv", "needs the radix cache (it spills evicted prefixes from it and "
                              "loads them back into it); drop --disable-radix-cache")  # fmt: skip
    if hierarchical_cache:
        raise MemxConfigError("--memx-peer-kv", "cannot run with --enable-hierarchical-cache yet (the peer tier "
                              "and HiCache's host tier would both fill the tree); drop one of the two")  # fmt: skip
    if device is None:  # upstream picks CUDA when there is one
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device) != "cpu":
        raise MemxConfigError("--memx-peer-kv", f"runs on CPU servers only for now (--device {device}); the CUDA "
                              "peer link is written but has never run on a GPU (docs/peer-kv.md)")  # fmt: skip
