"""Descriptions of (possibly sub-byte) numeric storage formats.

Upstream's quantisation code asks ``sgl_kernel.scalar_type`` for a handful of
named formats at import time (``scalar_types.uint4b8`` and friends) and reads
``size_bits``, ``id``, ``min()``/``max()`` and a few predicates from them. This
is an independent description of those formats; the CPU path never packs or
unpacks them, it only needs the objects to exist and answer truthfully.

Invariant: two formats are equal exactly when all their fields are equal, and
``id`` is a stable integer that encodes every field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NanRepr(enum.IntEnum):
    """How a floating format encodes NaN."""

    NONE = 0  # no NaN encoding
    IEEE_754 = 1  # exponent all ones, mantissa non-zero
    EXTD_RANGE_MAX_MIN = 2  # only the all-ones pattern is NaN (e.g. fp8 e4m3fn)


@dataclass(frozen=True)
class ScalarType:
    exponent: int  # exponent bits; 0 for integer formats
    mantissa: int  # mantissa bits (value bits for integers, sign excluded)
    signed: bool
    bias: int = 0  # stored = value + bias
    finite_values_only: bool = False
    nan_repr: NanRepr = NanRepr.IEEE_754

    # ------------------------------------------------------------ constructors
    @classmethod
    def int_(cls, size_bits: int, bias: int | None = None) -> ScalarType:
        return cls(0, size_bits - 1, True, bias or 0, nan_repr=NanRepr.NONE)

    @classmethod
    def uint(cls, size_bits: int, bias: int | None = None) -> ScalarType:
        return cls(0, size_bits, False, bias or 0, nan_repr=NanRepr.NONE)

    @classmethod
    def float_IEEE754(cls, exponent: int, mantissa: int) -> ScalarType:
        if mantissa <= 0 or exponent <= 0:
            raise ValueError("an IEEE 754 format needs exponent and mantissa bits")
        return cls(exponent, mantissa, True)

    @classmethod
    def float_(cls, exponent: int, mantissa: int, finite_values_only: bool, nan_repr: NanRepr) -> ScalarType:
        if nan_repr == NanRepr.IEEE_754:
            raise ValueError("use float_IEEE754 for IEEE 754 NaN encoding")
        return cls(exponent, mantissa, True, 0, finite_values_only, NanRepr(nan_repr))

    # -------------------------------------------------------------- properties
    @property
    def size_bits(self) -> int:
        bits = self.exponent + self.mantissa
        return bits + 1 if self.signed else bits

    @property
    def id(self) -> int:
        """Pack every field into one integer (bias in the high bits, two's complement)."""
        value = 0
        offset = 0
        for bits, field in (
            (8, self.exponent),
            (8, self.mantissa),
            (1, int(self.signed)),
            (1, int(self.finite_values_only)),
            (8, int(self.nan_repr)),
        ):
            value |= (field & ((1 << bits) - 1)) << offset
            offset += bits
        value |= (self.bias & ((1 << 32) - 1)) << offset
        return value

    @property
    def name(self) -> str:
        return str(self)

    def is_signed(self) -> bool:
        return self.signed

    def is_integer(self) -> bool:
        return self.exponent == 0

    def is_floating_point(self) -> bool:
        return self.exponent != 0

    def has_bias(self) -> bool:
        return self.bias != 0

    def has_infs(self) -> bool:
        return self.is_floating_point() and not self.finite_values_only

    def has_nans(self) -> bool:
        return self.is_floating_point() and self.nan_repr != NanRepr.NONE

    def is_ieee_754(self) -> bool:
        return self.is_floating_point() and self.nan_repr == NanRepr.IEEE_754 and not self.finite_values_only

    # ---------------------------------------------------------------- limits
    def max(self) -> int | float:
        """Largest representable value (after removing the bias)."""
        if self.is_integer():
            raw = (1 << self.mantissa) - 1
            return raw - self.bias
        exp_bias = (1 << (self.exponent - 1)) - 1
        top_exp = (1 << self.exponent) - 1
        if self.is_ieee_754() or (not self.finite_values_only and self.nan_repr != NanRepr.NONE):
            top_exp -= 1  # all-ones exponent is reserved for inf / NaN
            mant = (1 << self.mantissa) - 1
        elif self.nan_repr == NanRepr.EXTD_RANGE_MAX_MIN:
            mant = (1 << self.mantissa) - 2  # all-ones pattern is NaN
        else:
            mant = (1 << self.mantissa) - 1
        return (1 + mant / (1 << self.mantissa)) * 2.0 ** (top_exp - exp_bias) - self.bias

    def min(self) -> int | float:
        """Smallest (most negative) representable value (after removing the bias)."""
        if self.is_integer():
            return (-(1 << self.mantissa) if self.signed else 0) - self.bias
        return -self.max() - 2 * self.bias if self.signed else -self.bias

    def __str__(self) -> str:
        if self.is_floating_point():
            text = f"float{self.size_bits}_e{self.exponent}m{self.mantissa}"
            if not self.is_ieee_754():
                text += "f" if self.finite_values_only else ""
                text += {NanRepr.EXTD_RANGE_MAX_MIN: "n", NanRepr.NONE: "", NanRepr.IEEE_754: ""}[self.nan_repr]
        else:
            text = ("int" if self.signed else "uint") + str(self.size_bits)
        if self.has_bias():
            text += f"b{self.bias}"
        return text

    def __repr__(self) -> str:
        return f"ScalarType.{self}"


def _fp(exponent: int, mantissa: int, *, finite: bool = False, nan: NanRepr = NanRepr.IEEE_754) -> ScalarType:
    return ScalarType(exponent, mantissa, True, 0, finite, nan)


class scalar_types:
    """The named formats upstream refers to."""

    int4 = ScalarType.int_(4)
    uint4 = ScalarType.uint(4)
    int8 = ScalarType.int_(8)
    uint8 = ScalarType.uint(8)
    float8_e4m3fn = _fp(4, 3, finite=True, nan=NanRepr.EXTD_RANGE_MAX_MIN)
    float8_e5m2 = _fp(5, 2)
    float16_e8m7 = _fp(8, 7)
    float16_e5m10 = _fp(5, 10)
    float6_e3m2f = _fp(3, 2, finite=True, nan=NanRepr.NONE)
    float6_e2m3f = _fp(2, 3, finite=True, nan=NanRepr.NONE)
    float4_e2m1f = _fp(2, 1, finite=True, nan=NanRepr.NONE)
    # GPTQ-style formats: unsigned storage with a symmetric bias.
    uint2b2 = ScalarType.uint(2, 2)
    uint3b4 = ScalarType.uint(3, 4)
    uint4b8 = ScalarType.uint(4, 8)
    uint8b128 = ScalarType.uint(8, 128)
    bfloat16 = float16_e8m7
    float16 = float16_e5m10
