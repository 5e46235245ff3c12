"""The one adapter between memx and upstream SGLang.

Every upstream name memx reads, calls or patches is declared in ``manifest`` and reached
through the modules of this package, with plain attribute access: a name that is missing
in the installed SGLang raises where it is read (and fails ``test/upstream_compat`` first),
never turns a feature off silently. Modules, one per upstream subsystem: ``server_args``,
``http``, ``scheduler`` (scheduler state, batches, admission pass, prefill budget),
``request``, ``kv`` (KV pool and token allocators), ``radix`` (prefix cache), ``model``
(model config and forward). ``registry`` registers memx's hooks and checks at start-up
that they are in force; ``version`` holds the supported SGLang range.

Outside this package no memx module imports sglang.
"""
