"""Engine-independent machinery of the simulator (events, engine, links, KV
cache, requests, roofline, hardware and model tables, workloads, statistics,
the scheduler/hook contracts, the stock baseline scheduler, and the FineServe
decisions only the simulator makes: ``fineserve_policy``). Import the
submodules directly; this package imports nothing."""
