"""Activation memory of a forward pass, and how a batch gets it from the pool (eLLM E1/E2).

Numbers in, decisions out; nothing here touches memory.

* ``ActivationProfile``: bytes of live activations for a forward over
  ``tokens`` tokens in ``seqs`` sequences, ``fixed + per_token * tokens +
  per_seq * seqs`` (0 for an empty batch). ``from_model_dims`` derives it from
  a decoder's shapes; ``observe`` raises the coefficients so that the profile
  covers every peak measured since (it never lowers them: admission must stay
  an upper bound of what a batch needs).
* ``plan_activation``: eLLM Alg. 1's ballooning for one batch. The activation
  side holds ``held`` chunks; the batch needs ``need``. A shortfall comes from
  FREE chunks first, then from KV memory that is idle (lazy deflation: only
  the shortfall, §4.3.1, R6 in ``ellm``); if even that is not enough the batch
  does not fit and nothing is taken (no hold-and-wait). Idle activation chunks
  (``held - need``) stay with activation until KV asks for them (inflation).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int

__all__ = ["ActivationProfile", "BalloonStep", "plan_activation"]


@dataclass
class ActivationProfile:
    """``bytes_for(tokens, seqs) = fixed + per_token * tokens + per_seq * seqs`` (0 when tokens == 0)."""

    per_token_bytes: int
    per_seq_bytes: int = 0
    fixed_bytes: int = 0
    source: str = "given"
    observations: int = 0

    def __post_init__(self):
        check_int("per_token_bytes", self.per_token_bytes, 0)
        check_int("per_seq_bytes", self.per_seq_bytes, 0)
        check_int("fixed_bytes", self.fixed_bytes, 0)

    @classmethod
    def from_model_dims(
        cls,
        *,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab: int,
        itemsize: int,
        logits_itemsize: int = 4,
    ) -> ActivationProfile:
        """Upper bound of one decoder layer's live set per token, plus logits per sequence.

        Per token: the residual and the normed hidden state (2h), q/k/v
        ((heads + 2 kv_heads) d), the attention output (heads d) and the MLP's
        gate, up and activated product (3 I), all in the model dtype. Per
        sequence: the last position's logits and their softmax in float32.
        Layers run one after another, so one layer's set is the peak.
        """
        for name, v in (
            ("hidden", hidden),
            ("intermediate", intermediate),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("vocab", vocab),
            ("itemsize", itemsize),
            ("logits_itemsize", logits_itemsize),
        ):
            check_int(name, v, 1)
        per_token = itemsize * (2 * hidden + (2 * num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate)
        return cls(per_token_bytes=per_token, per_seq_bytes=2 * vocab * logits_itemsize, source="model dims")

    def bytes_for(self, tokens: int, seqs: int = 1) -> int:
        check_int("tokens", tokens, 0)
        check_int("seqs", seqs, 0)
        if tokens == 0:
            return 0
        return self.fixed_bytes + self.per_token_bytes * tokens + self.per_seq_bytes * max(1, min(seqs, tokens))

    def chunks_for(self, tokens: int, seqs: int, chunk_bytes: int) -> int:
        check_int("chunk_bytes", chunk_bytes, 1)
        return -(-self.bytes_for(tokens, seqs) // chunk_bytes)

    def observe(self, tokens: int, seqs: int, peak_bytes: int) -> bool:
        """Record a measured peak; raise ``per_token_bytes`` if the profile was below it. Return whether it rose."""
        check_int("peak_bytes", peak_bytes, 0)
        predicted = self.bytes_for(tokens, seqs)
        self.observations += 1
        if tokens == 0 or peak_bytes <= predicted:
            return False
        rest = peak_bytes - self.fixed_bytes - self.per_seq_bytes * max(1, min(seqs, tokens))
        self.per_token_bytes = max(self.per_token_bytes, -(-rest // tokens))
        self.source = "measured"
        return True


@dataclass(frozen=True)
class BalloonStep:
    """``fits``: the batch may run. ``take_free``: FREE chunks that become activation;
    ``deflate_kv``: idle KV chunks to give to activation (both 0 when it does not fit)."""

    fits: bool
    take_free: int = 0
    deflate_kv: int = 0

    @property
    def shortfall(self) -> int:
        return self.take_free + self.deflate_kv


def plan_activation(need: int, held: int, free_chunks: int, kv_idle_chunks: int) -> BalloonStep:
    """How activation reaches ``need`` chunks from ``held``: FREE first, then idle KV, else not at all."""
    check_int("need", need, 0)
    check_int("held", held, 0)
    check_int("free_chunks", free_chunks, 0)
    check_int("kv_idle_chunks", kv_idle_chunks, 0)
    short = need - held
    if short <= 0:
        return BalloonStep(True)
    take = min(short, free_chunks)
    deflate = short - take
    if deflate > kv_idle_chunks:
        return BalloonStep(False)
    return BalloonStep(True, take, deflate)
