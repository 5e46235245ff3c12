"""sglang-memx: SGLang with an integrated elastic memory subsystem.

This package is the SGLang-facing layer (plugin entry, ``--memx-*`` flags,
hooks, HTTP endpoints, CLI). The engine-agnostic mechanisms live in
``memory_ext``, which never imports sglang.
"""

__version__ = "0.1.0"
