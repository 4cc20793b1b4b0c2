"""`vllm-proxy serve | check | sim | demo`."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from proxy.config import ConfigError, ProxyConfig, load_config

CONFIG_ENV = "VLLM_PROXY_CONFIG"


def uvicorn_options(config: ProxyConfig) -> dict:
    """The server settings the data path needs: uvloop, httptools with our lean inference cycle
    (proxy/server.py), no access log, long keep-alive."""
    from proxy.server import ProxyProtocol

    return {
        "loop": "uvloop",
        "http": ProxyProtocol,
        "lifespan": "on",
        "access_log": False,
        "server_header": False,
        "proxy_headers": False,  # X-Forwarded-* rewriting costs per request and we log no client IPs
        "timeout_keep_alive": config.server.keep_alive_s,
        "timeout_graceful_shutdown": config.server.drain_timeout_s,
        "log_level": "warning",
    }


def app_from_env():
    """Factory for uvicorn workers: each worker process loads the config named in the env."""
    from proxy.app import ProxyApp

    path = os.environ[CONFIG_ENV]
    return ProxyApp(load_config(path), path)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    config = _load_or_exit(args.config)
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

        cleanup = prepare_multiprocess_dir()  # before the workers start: they write their metrics there
        from proxy import workers as supervisor

        try:
            return supervisor.serve(options, host, port, workers)
        finally:
            cleanup()
    else:
        from proxy.app import ProxyApp

        from proxy.drain import DrainingServer

        server = DrainingServer(uvicorn.Config(ProxyApp(config, os.path.abspath(args.config)), host=host, port=port,
                                               **options))
        server.run()
        return 0 if server.started else 3
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def cmd_check(args: argparse.Namespace) -> int:
    config = _load_or_exit(args.config)
    print(f"{args.config}: OK")
    print(f"  server: http://{config.server.host}:{config.server.port} (max body {config.server.max_body_bytes} bytes)")
    print(f"  routing policy: {config.routing.policy}")
    for b in config.backends:
        served = ", ".join(b.models) if b.models else "discovered"
        extra = " [trusts request mm kwargs]" if b.trust_request_mm_kwargs else ""
        print(f"  backend {b.name}: {b.url} (models: {served}){extra}")
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
    parser.add_argument("--log-level", default="info", help="debug | info | warning | error")
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

    demo = sub.add_parser("demo", help="a simulated fleet plus the proxy on policies/demo.yaml")
    demo.add_argument("--config", default=None, help="default: policies/demo.yaml")
    demo.add_argument("--time-scale", type=float, default=0.2, help="speed of the simulated GPUs (1 = realistic)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)
