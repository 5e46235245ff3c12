"""A free TCP port for a server process that binds it only later (seconds, after its imports).

A port from ``bind(0)`` is in the kernel's ephemeral range: until the server binds it, any outgoing
connection on the machine (health polls, gloo, another engine) may be handed the same port, and the
server then dies on "address already in use". Ports are picked below the ephemeral range and below the
range upstream SGLang picks its own scheduler (``nccl``) ports from, so neither can take them.

Invariant: the returned port was bindable on ``host`` when returned; falls back to ``bind(0)`` when no
port of the range is free.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 12000, 21999  # upstream picks 22000-29999; the kernel's ephemeral range starts at 32768 by default
ATTEMPTS = 64
_rng = random.Random()  # its own stream: a caller's random.seed must not make two processes pick alike


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    high = min(HIGH, _ephemeral_low() - 1)
    if high > LOW:
        for port in _rng.sample(range(LOW, high + 1), min(ATTEMPTS, high + 1 - LOW)):
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
