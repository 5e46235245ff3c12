"""``sglang-memx serve --config models.yaml`` (also ``python -m sglang_memx.serve``).

Order: read and validate the config, place the models, (``--dry-run``: print and stop;
``--emit gateway|k8s``: write the gateway / Kubernetes artefacts and stop),
claim the router's address (a taken port fails here; until the router serves, every request
on it is answered 503 "starting"), start every engine and wait until all are healthy, then
serve the router until SIGINT / SIGTERM; on the way out every engine and pool arbiter is stopped.

Exit status: 0 after a clean stop, 2 for a bad config (one line
``sglang-memx serve: error: <field>: <problem>``, nothing started), 1 if an engine fails
to start (its log tail is printed, the others are stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

from .config import ServeConfigError, load_config
from .placement import plan_placement
from .starting_responder import StartingResponder, claim_address

__all__ = ["add_arguments", "run", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="models.yaml (docs/router.md)")
    p.add_argument("--host", default=None, help="router host (overrides router.host)")
    p.add_argument("--port", type=int, default=None, help="router port (overrides router.port)")
    p.add_argument("--log-dir", default=None, help="engine logs (overrides launch.log_dir)")
    p.add_argument("--dry-run", action="store_true", help="validate, place, print the engine commands, exit")
    e = p.add_argument_group("beyond one machine (docs/router.md): write artefacts, start nothing")
    e.add_argument("--emit", choices=("gateway", "k8s"), default=None,
                   help="gateway: upstream's model gateway (multi-model mode) command + worker registrations; "
                   "k8s: Kubernetes manifests (one Pod per device, a Service per model, the gateway)")  # fmt: skip
    e.add_argument("--out", default=None, help="directory for --emit (default ./sglang-memx-<gateway|k8s>)")
    e.add_argument("--namespace", default="default", help="Kubernetes namespace (--emit)")
    e.add_argument("--image", default=None, help="engine image (default: sglang-memx:cpu / sglang-memx:gpu by device)")
    e.add_argument("--gateway-image", default="sglang-memx:gpu", help="image with sglang_router (--emit k8s)")
    e.add_argument("--worker-url-template", default="http://{service}.{namespace}.svc:{port}",
                   help="each engine's URL as the gateway reaches it; {service} {namespace} {port} "
                   "{engine_port} {model} {device}")  # fmt: skip
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(overrides router.api_key; the engines get it as --api-key)")  # fmt: skip


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        placement = plan_placement(config)
    except ServeConfigError as exc:
        print(f"sglang-memx serve: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "emit", None):
        from .emit import emit_command

        return emit_command(config, placement, args)
    from .launcher import EngineStartError, Launcher, engine_specs

    api_key = getattr(args, "api_key", None) or config.router.api_key
    try:  # what depends on the placement too (a model's ranks on its share of the cores)
        specs = engine_specs(config, placement, run_id=str(os.getpid()), log_dir=args.log_dir, api_key=api_key)
    except ServeConfigError as exc:
        print(f"sglang-memx serve: error: {exc}", file=sys.stderr)
        return 2
    _log("sglang-memx serve: placement (FineServe Alg. 1)\n" + placement.describe())
    if args.dry_run:
        for s in specs:
            argv = [("***" if api_key and a == api_key else a) for a in s.argv]  # never print the key
            print(json.dumps({"model": s.model, "engine": s.key, "replica": s.replica, "device": s.device,
                              "pool": s.pool, "env": s.env, "argv": argv}))  # fmt: skip
        return 0

    host = args.host or config.router.host
    port = config.router.port if args.port is None else args.port
    try:
        listener = claim_address(host, port)
    except OSError as exc:
        print(f"sglang-memx serve: error: router.port: cannot listen on {host}:{port}: {exc.strerror or exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    starting = StartingResponder(listener).start()  # 503 until the router serves
    _log(f'sglang-memx serve: router address {_url(listener)} claimed (503 "starting" until the engines are up)')
    launcher = Launcher(specs, log=_log)

    # SIGTERM / SIGINT unwind through ``finally`` (which stops every engine), during start-up
    # and after the router: uvicorn handles them while it serves, then raises them again.
    def on_signal(signum, frame):
        raise _Stop(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        launcher.start_all(config.launch.startup_timeout_s)
        from .launcher import HealthProbe, RestartPolicy

        h = config.health
        launcher.supervise(RestartPolicy(max_restarts=config.launch.max_restarts,
                                         window_s=config.launch.restart_window_s,
                                         backoff_s=config.launch.restart_backoff_s,
                                         backoff_max_s=max(30.0, config.launch.restart_backoff_s)),
                           startup_timeout_s=config.launch.startup_timeout_s,
                           health=None if h.interval_s is None else HealthProbe(h.interval_s, h.timeout_s,
                                                                                h.failures, h.path))  # fmt: skip
        starting.stop()
        _serve_router(config, placement, launcher, listener, api_key)
    except EngineStartError as exc:
        print(f"sglang-memx serve: error: {exc}", file=sys.stderr)
        return 1
    except _Stop as stop:
        _log(f"sglang-memx serve: {signal.Signals(stop.signum).name}, stopping")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
        starting.stop()
        launcher.stop_all()
        listener.close()
        _log("sglang-memx serve: every engine stopped")
    return 0


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signum)


def _serve_router(config, placement, launcher, listener: socket.socket, api_key: str | None = None) -> None:
    import uvicorn

    from .admission import AdmissionGate, policy_from_config
    from .router import EngineRoute, build_app

    device_of = {n: pm.device for n, pm in placement.models.items()}
    replicas = {m.name: [e for e in launcher.engines.values() if e.spec.model == m.name] for m in config.models}
    routes = {m.name: EngineRoute(m.name, launcher.engines[m.name].url, m.path, device_of[m.name],
                                  None if m.tpot_slo_ms is None else m.tpot_slo_ms / 1000.0,
                                  tuple((e.spec.key, e.url) for e in replicas[m.name]))
              for m in config.models}  # fmt: skip
    gate = AdmissionGate(policy_from_config(config, device_of))
    started = time.time()

    def status() -> dict:
        return {
            "started_at": started,
            "engines": {
                n: {
                    **e.info(),
                    "device": e.spec.device,
                    "pool": e.spec.pool,
                    "pool_dir": e.spec.pool_dir,
                    "log": e.spec.log_path,
                }
                for n, e in launcher.engines.items()
            },  # fmt: skip
            "devices": {
                d.name: {"kind": d.kind, "models": list(d.models), "pool_budget_gb": d.pool_budget_gb}
                for d in placement.devices.values()
            },  # fmt: skip
        }

    app = build_app(routes, gate, alive=lambda n: launcher.engines[n].alive(),
                    engine_state=lambda n: launcher.engines[n].state, engine_info=lambda n: launcher.engines[n].info(),
                    api_key=api_key, request_timeout_s=config.router.request_timeout_s, status=status,
                    activity_interval_s=0.2)  # fmt: skip
    host, port = listener.getsockname()[:2]
    _log(f"sglang-memx serve: router on {_url(listener)} for {', '.join(routes)}")
    # On SIGTERM uvicorn waits for open requests; bounded, so a request queued for a restarting
    # engine (or a long stream) cannot hold the shutdown for minutes.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=30))  # fmt: skip
    server.run(sockets=[listener])  # the address claimed at start


def _url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sglang-memx serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    return run(p.parse_args(argv))
