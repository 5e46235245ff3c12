"""The coordinator: what composes memx's parts inside one SGLang server, one per device.

``elastic`` is the KV core (demand, eviction, shared pool, host buffer, pool paths);
``weights`` (lending, remap, sleep) and ``peer`` (the peer KV tier, the layer stream cache)
are mechanisms built on it. Their composition sits here, above all three:

* ``device``: the per-device ``Coordinator``: the KV space and its typed components
  (``components``, declared by ``parts.Component``), the iteration order and the
  short-allocation order derived from their ranks, both printed in ``/memx/status``;
* ``tick``: runs the iteration order once per scheduler iteration, including answering
  the arbiter's reclaims with layers too;
* ``pool_build``: the KV pool build with its optional parts (the layer stream cache).

Invariant: ``elastic`` imports neither ``weights`` nor ``peer``, and they never import this
package; hooks import it (``test/unit/test_layering.py``).
"""
