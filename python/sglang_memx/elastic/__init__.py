"""Elastic KV inside SGLang (``--memx-elastic-kv``): the KV core (pooled groups, demand, eviction,
admission, shared pool, host buffer, pool paths). ``weights`` and ``peer`` build on it; it imports
neither (their parts of a tick or a pool build are composed in ``coordinator``)."""
