"""``sglang-memx`` command line.

sglang-memx models prepare [--force]     convert the embedded SmolLM2 once, print its path
           [--fp32 | --all]              ... its float32 copy (KV cell 2x) / both, one path a line
sglang-memx models path [--fp32]         print where the embedded model (its float32 copy) lives
sglang-memx models serve-config          prepare both, write the models.yaml scripts/serve.sh serves
sglang-memx models tiny --out DIR ...    write a deterministic tiny random model
sglang-memx models family --out DIR --family F   ... of another attention family (MLA, SWA, hybrid)
sglang-memx status [--url URL]           print a running server's /memx/status
sglang-memx top [--once] [--url URL ...] live view of every pool and server on this machine
                 [--router URL]          ... and the models of a `serve` router (placement, state)
sglang-memx pool list | stop NAME        shared pools (arbiters) on this machine
sglang-memx serve --config models.yaml   several models behind one OpenAI router (docs/router.md)
sglang-memx version                      plugin and upstream versions
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def _cmd_models_prepare(args) -> int:
    from sglang_memx.models.embedded import EmbeddedModelError, prepare_embedded_model
    from sglang_memx.models.embedded_fp32 import prepare_fp32_model

    log = lambda *a, **k: print(*a, file=sys.stderr, **k)
    try:
        paths = []
        if not args.fp32:  # --all: the bf16 copy too (--force rebuilds each named copy)
            paths.append(prepare_embedded_model(args.cache_root, force=args.force, log=log))
        if args.fp32 or args.all:
            paths.append(prepare_fp32_model(args.cache_root, force=args.force, log=log))
    except EmbeddedModelError as exc:
        print(f"sglang-memx models prepare: error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(map(str, paths)))
    return 0


def _cmd_models_path(args) -> int:
    from sglang_memx.models.embedded import embedded_model_dir
    from sglang_memx.models.embedded_fp32 import fp32_model_dir

    print(fp32_model_dir(args.cache_root) if args.fp32 else embedded_model_dir(args.cache_root))
    return 0


def _cmd_models_serve_config(args) -> int:
    import shlex

    from sglang_memx.models.embedded import EmbeddedModelError, embedded_model_dir
    from sglang_memx.models.embedded_fp32 import prepare_fp32_model
    from sglang_memx.models.serve_config import ServeOptions, default_config_path, write_serve_config
    from sglang_memx.serve.config import ServeConfigError

    prog = "sglang-memx models serve-config"
    server_args = list(args.server_args)
    if server_args[:1] == ["--"]:
        server_args = server_args[1:]
    defaults = ServeOptions()
    opts = ServeOptions(
        host=args.host,
        port=args.port,
        memory_gb=args.memory_gb,
        max_total_tokens=args.max_total_tokens,
        memx_args=defaults.memx_args if args.memx_args is None else tuple(shlex.split(args.memx_args)),
        server_args=tuple(server_args),
        log_dir=args.log_dir,
    )
    log = lambda *a, **k: print(*a, file=sys.stderr, **k)
    try:
        fp32 = prepare_fp32_model(args.cache_root, log=log)  # prepares (and verifies) the bf16 copy first
        bf16 = embedded_model_dir(args.cache_root)
        path = write_serve_config(args.out or default_config_path(args.port), bf16, fp32, opts)
    except EmbeddedModelError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except ServeConfigError as exc:
        hint = ""  # where the bad value came from, for users of scripts/serve.sh
        if ".server_args" in exc.field:
            hint = (" (the extra arguments go to every engine's launch_server; the router's host and port: "
                    "--host / --port here, MEMX_HOST / MEMX_PORT for scripts/serve.sh)")  # fmt: skip
        elif exc.field.startswith("launch.memx_args"):
            hint = " (--memx-args here, MEMX_FEATURES for scripts/serve.sh)"
        print(f"{prog}: error: {exc}{hint}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_models_tiny(args) -> int:
    from sglang_memx.models.tiny import TinyModelSpec, generate_tiny_model

    spec = TinyModelSpec(
        arch=args.arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        seed=args.seed,
    )
    try:
        spec.validate()
    except ValueError as exc:
        print(f"sglang-memx models tiny: error: {exc}", file=sys.stderr)
        return 2
    print(generate_tiny_model(spec, args.out))
    return 0


def _cmd_models_family(args) -> int:
    from sglang_memx.models.tiny_families import TinyFamilySpec, generate_family_model

    spec = TinyFamilySpec(
        family=args.family, num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab, seed=args.seed
    )
    try:
        spec.validate()
    except ValueError as exc:
        print(f"sglang-memx models family: error: {exc}", file=sys.stderr)
        return 2
    print(generate_family_model(spec, args.out))
    return 0


def _cmd_status(args) -> int:
    url = args.url.rstrip("/") + args.path
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            doc = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"sglang-memx status: error: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    return 0


def _pool_dir(args):
    from sglang_memx.config import MemxConfig
    from sglang_memx.elastic.paths import pool_dir

    return pool_dir(MemxConfig(elastic_kv=True, pool_dir=args.pool_dir))


def _cmd_top(args) -> int:
    from sglang_memx.top import run

    if args.interval <= 0:
        print("sglang-memx top: error: argument --interval: must be positive", file=sys.stderr)
        return 2
    import os

    api_key = args.api_key or os.environ.get("SGLANG_MEMX_API_KEY") or None
    return run(_pool_dir(args), args.url or [], args.interval, args.once, routers=args.router or [], api_key=api_key)


def _cmd_pool_list(args) -> int:
    from sglang_memx.top import collect

    snap = collect(_pool_dir(args), [])
    for p in snap["pools"]:
        if "error" in p:
            print(f"{p['name']}\t{'stale' if 'stale' in p else 'unreachable'}\t{p['socket']}")
        else:
            held = sum(c["held"] for c in p["clients"])
            print(
                f"{p['name']}\t{held}/{p['budget']} chunks of {p['granularity']} B lent\t"
                f"{len(p['clients']) - 1} client(s)\t{p['socket']}"
            )
    return 0


def _cmd_pool_stop(args) -> int:
    import os
    import signal

    directory = _pool_dir(args)
    pid_file = directory / f"{args.name}.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        print(f"sglang-memx pool stop: error: no running pool {args.name!r} in {directory}", file=sys.stderr)
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        print(f"sglang-memx pool stop: pool {args.name!r} was not running (stale pid file removed)")
        return 0
    print(f"stopped pool {args.name!r} (arbiter pid {pid})")
    return 0


def _cmd_version(args) -> int:
    from sglang_memx import __version__
    from sglang_memx.upstream import version

    supported = "supported" if version.is_supported(version.installed_sglang()) else "NOT supported"
    print(
        f"sglang-memx {__version__} (upstream sglang {version.installed_sglang()}, {supported}; "
        f"supported range {version.SUPPORTED_SGLANG})"
    )
    return 0


def _cmd_hooks(args) -> int:
    from sglang_memx.hooks import hook_table

    print(hook_table())
    return 0


def _cmd_profile(args) -> int:
    from sglang_memx.weights.profiler import profile

    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    extra = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    record = profile(args.model_path, args.out, batch_sizes=batches, decode_tokens=args.decode_tokens,
                     device=args.device, extra_args=extra, log_path=args.log)  # fmt: skip
    per_batch = ", ".join(f"b{b}: {s * 1e3:.3f} ms" for b, s in record.decode_layer_s.items())
    print(f"{args.out}: {record.n_layers} layers of {record.layer_bytes / (1 << 20):.2f} MiB; copy "
          f"{record.link_bytes_per_s / 1e9:.2f} GB/s (T_T {record.layer_transfer_s * 1e3:.3f} ms); decode per layer "
          f"{per_batch}; prefill {record.prefill_layer_s_per_token * 1e6:.2f} us/token/layer")  # fmt: skip
    return 0


def _cmd_serve(args) -> int:
    from sglang_memx.serve.main import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-memx", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="embedded and tiny models")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert the embedded SmolLM2 to bf16 safetensors (idempotent)")
    prep.add_argument("--force", action="store_true", help="rebuild even if a valid copy exists")
    prep.add_argument("--cache-root", default=None, help="models folder (default: $SGLANG_MEMX_HOME/models)")
    which = prep.add_mutually_exclusive_group()
    which.add_argument("--fp32", action="store_true", help="the float32 copy (widened from the bf16 one) instead")
    which.add_argument("--all", action="store_true", help="both copies, bf16 first, one path a line")
    prep.set_defaults(func=_cmd_models_prepare)
    path = msub.add_parser("path", help="print the embedded model directory")
    path.add_argument("--cache-root", default=None)
    path.add_argument("--fp32", action="store_true", help="the float32 copy's directory")
    path.set_defaults(func=_cmd_models_path)
    scfg = msub.add_parser("serve-config", help="prepare both embedded copies, write scripts/serve.sh's models.yaml "
                           "(validated and placed as `serve` will), print its path")  # fmt: skip
    scfg.add_argument("--out", default=None, help="default: $SGLANG_MEMX_HOME/serve/models-<port>.yaml")
    scfg.add_argument("--host", default="127.0.0.1", help="router host")
    scfg.add_argument("--port", type=int, default=30000, help="router port")
    scfg.add_argument("--memory-gb", type=float, default=2.0, help="the CPU device's memory: weights + shared pool")
    scfg.add_argument("--max-total-tokens", type=int, default=16384, help="logical KV tokens per model")
    scfg.add_argument("--memx-args", default=None,
                      help="memx flags for every engine besides elastic KV + the shared pool, one string "
                      "(default '--memx-host-buffer-gb 1'; '' for none)")  # fmt: skip
    scfg.add_argument("--log-dir", default=None, help="engine logs (default $SGLANG_MEMX_HOME/serve/logs-<port>)")
    scfg.add_argument("--cache-root", default=None, help="models folder (default: $SGLANG_MEMX_HOME/models)")
    scfg.add_argument("server_args", nargs=argparse.REMAINDER,
                      help="after --: launch_server flags for every engine")  # fmt: skip
    scfg.set_defaults(func=_cmd_models_serve_config)
    tiny = msub.add_parser("tiny", help="write a deterministic tiny random model")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=64)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--head-dim", type=int, default=16)
    tiny.add_argument("--intermediate", type=int, default=128)
    tiny.add_argument("--vocab", type=int, default=512)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_models_tiny)
    fam = msub.add_parser("family", help="write a deterministic tiny random model of an attention family")
    fam.add_argument("--out", required=True)
    fam.add_argument("--family", required=True, help="see sglang_memx.models.tiny_families.ARCHITECTURES")
    fam.add_argument("--layers", type=int, default=2)
    fam.add_argument("--hidden", type=int, default=64)
    fam.add_argument("--vocab", type=int, default=512)
    fam.add_argument("--seed", type=int, default=0)
    fam.set_defaults(func=_cmd_models_family)

    status = sub.add_parser("status", help="print a running server's memx status")
    status.add_argument("--url", default="http://127.0.0.1:30000")
    status.add_argument("--path", default="/memx/status")
    status.add_argument("--timeout", type=float, default=10.0)
    status.set_defaults(func=_cmd_status)

    top = sub.add_parser("top", help="live view of every memx pool and server on this machine")
    top.add_argument("--url", action="append", help="also show this server (repeatable)")
    top.add_argument("--router", action="append", help="an `sglang-memx serve` router: its models, placement and "
                     "engine states (repeatable)")  # fmt: skip
    top.add_argument("--api-key", default=None, help="bearer key for routers / servers that need one "
                     "(default $SGLANG_MEMX_API_KEY)")  # fmt: skip
    top.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument("--pool-dir", default=None, help="pool sockets directory (as --memx-pool-dir)")
    top.set_defaults(func=_cmd_top)

    pool = sub.add_parser("pool", help="shared pools (per-device arbiters)")
    psub = pool.add_subparsers(dest="pool_command", required=True)
    plist = psub.add_parser("list", help="list the pools and their use")
    plist.add_argument("--pool-dir", default=None)
    plist.set_defaults(func=_cmd_pool_list)
    pstop = psub.add_parser("stop", help="stop a pool's arbiter (its servers lose the pool)")
    pstop.add_argument("name")
    pstop.add_argument("--pool-dir", default=None)
    pstop.set_defaults(func=_cmd_pool_stop)

    hooks = sub.add_parser("hooks", help="print the table of upstream targets memx hooks (Markdown)")
    hooks.set_defaults(func=_cmd_hooks)

    prof = sub.add_parser("profile", help="measure a model's layer profile here (for --memx-weights-profile)")
    prof.add_argument("--model-path", required=True)
    prof.add_argument("--out", required=True, help="where to write the profile (JSON)")
    prof.add_argument("--batch-sizes", default="1,2,4,8", help="decode batch sizes to time (default 1,2,4,8)")
    prof.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per request")
    prof.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    prof.add_argument("--log", default="sglang-memx-profile.log", help="the profiling server's log file")
    prof.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: more launch_server flags")
    prof.set_defaults(func=_cmd_profile)

    from sglang_memx.serve.main import add_arguments as serve_arguments

    serve = sub.add_parser("serve", help="serve several models behind one OpenAI-compatible router")
    serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    ver = sub.add_parser("version", help="print versions")
    ver.set_defaults(func=_cmd_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
