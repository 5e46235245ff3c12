"""Where donors listen: one socket per donor in the shared pool's private directory.

``<pool dir>/<pool>.peer.<donor>.sock`` next to the arbiter's ``<pool>.sock``: a borrower of
pool ``P`` finds every donor of ``P`` by listing the directory (``donor_sockets``), and never
one of another pool. Names follow the pool-name rule (letters, digits, ``_ . -``), so a path
cannot leave the directory. The directory must already be private (``vmm.ipc.listen_unix``
refuses to bind anywhere else).
"""

from __future__ import annotations

import os
import re
import stat

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_INFIX = ".peer."
_SUFFIX = ".sock"


def _check(field: str, value) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or _INFIX in f".{value}.":
        raise ValueError(
            f"{field}: must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter or digit, "
            f"not containing '.peer.'), got {value!r}"
        )
    return value


def donor_socket(pool_dir, pool: str, donor: str) -> str:
    """The socket path donor ``donor`` of pool ``pool`` listens on."""
    return os.path.join(os.fspath(pool_dir), f"{_check('pool', pool)}{_INFIX}{_check('donor', donor)}{_SUFFIX}")


def donor_sockets(pool_dir, pool: str, *, exclude: str | None = None) -> dict[str, str]:
    """``{donor name: socket path}`` of the donors of ``pool`` listening now (``exclude``: oneself)."""
    prefix = f"{_check('pool', pool)}{_INFIX}"
    out = {}
    try:
        names = sorted(os.listdir(os.fspath(pool_dir)))
    except FileNotFoundError:
        return out
    for entry in names:
        if not entry.startswith(prefix) or not entry.endswith(_SUFFIX):
            continue
        donor = entry[len(prefix) : -len(_SUFFIX)]
        if not _NAME.fullmatch(donor) or donor == exclude:
            continue
        path = os.path.join(os.fspath(pool_dir), entry)
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            out[donor] = path
    return out
