"""The peer KV tier inside the server (``--memx-peer-kv``): ``server`` wires
``memory_ext.peer`` (donor, borrower tier, KV spill / load) into one scheduler; ``checks``
refuses the flag combinations it cannot serve. See docs/peer-kv.md."""

import os

from sglang_memx.upstream import server_args as up_args


def peer_name(server_args) -> str:
    """This server's name in its pool's peer tier (donor socket, lease, borrower): ``s<port>-<pid>``."""
    return f"s{up_args.server_url(server_args).rsplit(':', 1)[-1]}-{os.getpid()}"
