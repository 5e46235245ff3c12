"""One request, its static description (from the workload) and its run-time
state (owned by the engine).

Token bookkeeping invariants for a request being served:

* ``target = prompt_len + generated`` tokens must be in the KV before the next
  token can be sampled by a prefill (after a preemption the generated tokens
  are recomputed together with the prompt, as stock engines do);
* while decoding, ``ctx == prompt_len + generated - 1`` (the last sampled
  token's KV is written by the next decode step);
* the request finishes when ``generated == output_len``.

Content identity: token ``i`` of a request belongs to its ``lineage`` (a
session: every turn of a conversation shares it), except the first
``sys_len`` tokens which belong to the shared system prompt ``sys_key``. Two
requests with the same block key hold identical KV for that block.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Request", "WAITING", "RUNNING", "FINISHED", "PENDING"]

PENDING, WAITING, RUNNING, FINISHED = 0, 1, 2, 3


class Request:
    __slots__ = (
        # static
        "rid",
        "model",
        "arrival",
        "prompt_len",
        "output_len",
        "lineage",
        "sys_key",
        "sys_len",
        "next_turn",
        "think_s",
        "turn",
        # run time
        "state",
        "ctx",
        "generated",
        "decoding",
        "cached_keys",
        "private_blocks",
        "first_token_t",
        "finish_t",
        "last_token_t",
        "admitted_t",
        "preemptions",
        "prefix_hit_tokens",
        "computed_tokens",
        "offloaded_blocks",
        "tag",
    )

    def __init__(
        self,
        rid: int,
        model: int,
        arrival: float,
        prompt_len: int,
        output_len: int,
        lineage: Hashable = None,
        sys_key: Hashable = None,
        sys_len: int = 0,
        next_turn: int = -1,
        think_s: float = 0.0,
        turn: int = 0,
    ) -> None:
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"request {rid}: prompt_len and output_len must be >= 1")
        self.rid, self.model, self.arrival = rid, model, arrival
        self.prompt_len, self.output_len = int(prompt_len), int(output_len)
        self.lineage = ("r", rid) if lineage is None else lineage
        self.sys_key, self.sys_len = sys_key, int(sys_len) if sys_key is not None else 0
        self.next_turn, self.think_s, self.turn = next_turn, think_s, turn
        self.state = PENDING
        self.ctx = 0
        self.generated = 0
        self.decoding = False
        self.cached_keys: list[Hashable] = []
        self.private_blocks = 0
        self.first_token_t: float | None = None
        self.finish_t: float | None = None
        self.last_token_t = 0.0
        self.admitted_t: float | None = None
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.computed_tokens = 0
        self.offloaded_blocks = 0
        self.tag = None  # free slot for schedulers / hooks

    @property
    def target(self) -> int:
        """Tokens that must be in the KV before a prefill can sample."""
        return self.prompt_len + self.generated

    def block_key(self, j: int, block_size: int) -> Hashable:
        if (j + 1) * block_size <= self.sys_len:
            return (self.sys_key, j)
        return (self.lineage, j)

    def block_keys(self, start: int, stop: int, block_size: int) -> list[Hashable]:
        return [self.block_key(j, block_size) for j in range(start, stop)]

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid}, model={self.model}, prompt={self.prompt_len}, "
            f"out={self.output_len}, gen={self.generated}, ctx={self.ctx})"
        )
