"""SwiftCache decision logic (W2-W4) as plain policy objects: numbers in, decisions out.

Nothing here allocates, maps or moves memory; there is no torch and no sglang.
Only the standard library (dataclasses, enum, math, collections) is used.

* W2 -- sizing of the master's layer stream cache (LSC) and regular cache (RC),
  paper section 3.2, Eq. 1-5: :func:`layer_block_bytes`, :func:`worker_full_layer_blocks`,
  :func:`master_single_layer_blocks`, :func:`plan_lsc_from_blocks`, :func:`plan_lsc`;
  its layer-granular realisation in a server (:func:`plan_layer_stream`).
* W3 -- block-major elastic cache and its minimum elastic unit (MEU), section 3.4,
  Eq. 6-9: :func:`block_elems`, :func:`block_major_shape`, :func:`min_elastic_unit`.
* W4 -- worker scale up / scale down, section 3.5, Algorithm 1: :func:`scale_up`,
  :func:`scale_down`, the sliding :class:`RequestWindow` and the bookkeeping
  :class:`ElasticWorkerPolicy` that applies decisions to its own counters.

Modules: ``geometry`` (Eq. 1-3), ``lsc`` (W2), ``elastic_unit`` (W3, R9), ``scaling``
(Alg. 1 as functions), ``elastic_worker`` (the window and a worker's counters), ``donation``
(the donor's policy in chunks); this package re-exports their public names.

Readings of the paper where it is not explicit (each one is tested):

R1 (Eq. 5) when sum(K_i) >= K_master the floor would be negative; the text says
   "leaving no space for RC", so N_RC is clamped at 0.
R2 (Eq. 1-3) byte quantities may be any non-negative integers; M_block must come
   out integral (e.g. INT4 with dtype_bytes=0.5 needs an even element count).
R3 (Eq. 6-9) Eq. 6/7 count elements of one K (or V) plane over all layers of a
   block. The physical block also holds V and its dtype may differ between the
   two models, so the alignment is computed on whole-block *bytes*
   (2 x BE x dtype_bytes). With equal dtypes this gives exactly Eq. 9's MEU_m /
   MEU_i (the common factor 2 x dtype cancels); ``lcm_elems`` is still reported
   literally as Eq. 8.
R4 (Alg. 1, SCALEUP) N_i is the worker's current allocation and ``need`` is the
   block demand of the incoming request (ceil(request_len / B_i)); a caller that
   wants aggregate demand passes the aggregate token count. The paper does not
   cap the reclaim; here, when ``donated_blocks`` (worker blocks currently lent
   to the master) is given, at most floor(donated / MEU_i) MEUs are reclaimed and
   the unmet rest is reported as ``shortfall_blocks``. ``donated_blocks=None``
   is the paper's uncapped behaviour.
R5 (Alg. 1, SCALEDOWN) an empty window has max_len = 0, so everything above
   ``min_blocks`` (default 0) may be released, in whole MEUs (floor). Release
   never takes the allocation below max(max_need, min_blocks) nor below 0.
R6 "the last t seconds" is inclusive: a request recorded at time ts is in the
   window at time now iff now - t <= ts <= now.
R7 direction: SCALE_UP means the worker gains k*MEU_i blocks and the master
   gives back k*MEU_m blocks; SCALE_DOWN is the reverse (worker donates).
R8 (Alg. 1, SCALEDOWN) the paper donates everything the window did not need. A donor
   may cap its donation (``max_donated_blocks``, e.g. --memx-peer-donate-max-gb): the
   release is then at most floor((cap - donated) / MEU_i) MEUs, never negative.
R9 (Eq. 6-9 on a chunked pool) memory moves between processes in pool chunks, so the
   unit that both sides and the pool can move without waste is
   lcm(master block bytes, worker block bytes, chunk bytes): ``chunk_aligned_unit``
   scales the MEU by the smallest factor making ``meu_bytes`` a multiple of the chunk.
   A donor whose KV is backed in chunk-aligned groups (memx's LayeredKVBuffers) passes
   its group as its block, which makes the factor 1.

The donor side of the peer tier (``DonationPolicy``) is ``ElasticWorkerPolicy`` on the
chunk-aligned unit, with decisions also expressed in chunks: its own demand in tokens in,
how many chunks to donate or reclaim out. The simulator's swiftcache mechanism drives the same
ElasticWorkerPolicy, so both take Alg. 1's decisions from one implementation.
"""

from .donation import DonationPolicy, DonationStep
from .elastic_unit import ElasticUnit, block_elems, block_major_shape, chunk_aligned_unit, min_elastic_unit
from .elastic_worker import ElasticWorkerPolicy, RequestWindow
from .geometry import KVGeometry, layer_block_bytes, master_single_layer_blocks, worker_full_layer_blocks
from .lsc import LayerStreamPlan, LSCPlan, plan_layer_stream, plan_lsc, plan_lsc_from_blocks
from .scaling import ScaleAction, ScaleDecision, blocks_for_tokens, scale_down, scale_up

__all__ = [
    "KVGeometry",
    "LSCPlan",
    "ElasticUnit",
    "ScaleAction",
    "ScaleDecision",
    "RequestWindow",
    "ElasticWorkerPolicy",
    "layer_block_bytes",
    "worker_full_layer_blocks",
    "master_single_layer_blocks",
    "plan_lsc_from_blocks",
    "plan_lsc",
    "LayerStreamPlan",
    "plan_layer_stream",
    "block_elems",
    "block_major_shape",
    "min_elastic_unit",
    "blocks_for_tokens",
    "scale_up",
    "scale_down",
    "chunk_aligned_unit",
    "DonationStep",
    "DonationPolicy",
]
