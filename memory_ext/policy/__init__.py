"""Decision logic of the five papers as plain objects: numbers in, decisions out.

Invariant: no module here allocates, maps or moves memory, imports torch for
tensors, or imports sglang. Each policy is driven identically by the
simulator (benchmark/sim) and, later, by the real system through hooks.

Modules: ``oneiros`` (remap controller, O2-O5), ``select_n`` (performance
record and bandwidth coordinator, S2-S3), ``ellm`` (ballooning admission and
SLO buffer scaling, E4), FineServe's server-side parts ``kv_format`` (KV token
sizes and slab formats, F1/F2), ``slab_table`` (the slab table, F1) and
``placement`` (Alg. 1, F3) -- its simulator-only parts (pinned placement,
Static*, Alg. 2 EDF batching) are ``benchmark.sim.core.fineserve_policy`` --,
``swiftcache`` (LSC sizing, minimum elastic unit, scale up/down, W2-W4),
``edf_admission`` (router admission: EDF over TTFT deadlines, priority,
in-flight caps, shedding; F3's second level), ``arbiter`` (node-wide memory
arbiter that composes them, X1).
"""
