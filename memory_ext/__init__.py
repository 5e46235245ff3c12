"""memory_ext: the engine-agnostic memory subsystem of sglang-memx.

Invariant: nothing in this package imports sglang. Policies take numbers and
return decisions; mechanisms move bytes.
"""

__version__ = "0.1.0"
