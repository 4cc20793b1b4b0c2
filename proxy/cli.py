"""`vllm-proxy serve | check | sim | demo`."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from proxy.checks import cross_check, startup_problems
from proxy.config import ConfigError, ProxyConfig, load_config
from proxy.logsetup import configure as configure_logging

CONFIG_ENV = "VLLM_PROXY_CONFIG"


def uvicorn_options(config: ProxyConfig) -> dict:
    """The server settings the data path needs: uvloop, httptools with our lean inference cycle
    (proxy/server.py), no access log, long keep-alive."""
    from proxy.server import ProxyProtocol

    return {
        "loop": "uvloop",
        "http": ProxyProtocol.configured(config.server),
        "lifespan": "on",
        "ws": "none",  # no WebSocket endpoints: an upgrade request is answered as plain HTTP
        "access_log": False,
        "server_header": False,
        "proxy_headers": False,  # X-Forwarded-* rewriting costs per request and we log no client IPs
        "timeout_keep_alive": config.server.keep_alive_s,
        "timeout_graceful_shutdown": config.server.drain_timeout_s,
        "log_level": "warning",
        "log_config": None,  # uvicorn's records go through our handler (proxy/logsetup.py): timestamped, with the worker
    }


def app_from_env():
    """Factory for uvicorn workers: each worker process loads the config named in the env."""
    from proxy.app import ProxyApp

    path = os.environ[CONFIG_ENV]
    return ProxyApp(load_config(path), path)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    loaded = config = _load_or_exit(args.config)
    try:
        startup_problems(loaded, args.config)  # e.g. an unreadable key_file: refuse here, naming its key path
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for warning in cross_check(loaded).errors:  # `check` fails on these; a running proxy just serves less
        logging.getLogger("vllm_proxy").warning("%s: %s", args.config, warning)
    server = config.server
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v is not None}
    if updates:
        config = config.model_copy(update={"server": server.model_copy(update=updates)})
    os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    options = uvicorn_options(config)
    host, port, workers = config.server.host, config.server.port, config.server.workers
    # uvicorn drains in-flight requests on SIGTERM, then re-raises the signal: make that an exit 0
    signal.signal(signal.SIGTERM, _exit_cleanly)
    print(f"vllm-proxy serving http://{host}:{port}/v1 ({workers} worker{'s' if workers > 1 else ''})", flush=True)
    if workers > 1:
        from proxy.metrics import prepare_multiprocess_dir

        configure_logging(args.log_level, args.log_format, role="supervisor")
        cleanup = prepare_multiprocess_dir()  # before the workers start: they write their metrics there
        from proxy import workers as supervisor

        try:
            return supervisor.serve(options, host, port, workers)
        finally:
            cleanup()
    else:
        from proxy.app import ProxyApp

        from proxy.drain import DrainingServer

        # the app runs the file's config (a reload compares the file with it); flags only move the socket
        server = DrainingServer(uvicorn.Config(ProxyApp(loaded, os.path.abspath(args.config)), host=host, port=port,
                                               **options))
        server.run()
        return 0 if server.started else 3
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def cmd_check(args: argparse.Namespace) -> int:
    """Schema, then cross-references (proxy/checks.py); exit 2 on any error. Never a traceback:
    whatever the input, the answer is a message."""
    try:
        config = load_config(args.config)
        found = cross_check(config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug of ours must still not look like a crash to an operator
        print(f"{args.config}: cannot check: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for warning in found.warnings:
        print(f"{args.config}: warning: {warning}", file=sys.stderr)
    if found.errors:
        print(str(ConfigError(args.config, found.errors)), file=sys.stderr)
        return 2
    print(f"{args.config}: OK")
    print(f"  server: http://{config.server.host}:{config.server.port} (max body {config.server.max_body_bytes} bytes)")
    print(f"  routing policy: {config.routing.policy}")
    for b in config.backends:
        served = ", ".join(b.models) if b.models else "discovered"
        extra = " [trusts request mm kwargs]" if b.trust_request_mm_kwargs else ""
        print(f"  backend {b.name}: {b.url} (models: {served}){extra}")
    for src in config.backends_from:
        k8s = src.kubernetes
        where = (f"DNS {src.dns.record} {src.dns.host}" if src.dns else
                 f"Kubernetes {'EndpointSlices of service ' + k8s.service if k8s.service else 'pods ' + str(k8s.selector)}")
        print(f"  backends from {src.name}: {where}")
    for d in config.deployments or []:
        target = d.model + (f" + adapter {d.adapter}" if d.adapter else "")
        print(f"  deployment {d.name} -> {target}")
    if config.deployments is None:
        print("  deployments: every model and adapter the backends report, under its own id")
    return 0


def _load_or_exit(path: str) -> ProxyConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None


def cmd_sim(args: argparse.Namespace) -> int:
    from proxy.sim.cli import run

    return run(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from proxy.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-proxy", description=__doc__)
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "warn", "error", "critical"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="operator log lines (stderr): text, or one JSON object per line")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", required=True, help="policy YAML")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--workers", type=int)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check", help="validate a policy YAML and print a summary")
    check.add_argument("--config", required=True)
    check.set_defaults(func=cmd_check)

    sim = sub.add_parser("sim", help="run one simulated vLLM replica")
    from proxy.sim.cli import add_arguments

    add_arguments(sim)
    sim.set_defaults(func=cmd_sim)

    demo = sub.add_parser("demo", help="a simulated fleet plus the proxy on the demo policy")
    demo.add_argument("--config", default=None, help="default: policies/demo.yaml (shipped in the package)")
    demo.add_argument("--time-scale", type=float, default=0.2, help="speed of the simulated GPUs (1 = realistic)")
    demo.add_argument("--port", type=int, default=None,
                      help="proxy port; the replicas take the next ones (default: the policy's ports)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return args.func(args)
