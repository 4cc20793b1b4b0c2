"""Command line of the simulator, using vLLM's flag names so scripts can swap in real vLLM."""
from __future__ import annotations

import argparse

from proxy.sim.config import SimConfig

_DEFAULTS = SimConfig()


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--model", default=d.model)
    add("--served-model-name", nargs="+", default=None, help="the first name is the model id served")
    add("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH")
    add("--max-loras", type=int, default=d.max_loras, help="distinct adapters per running batch")
    add("--max-cpu-loras", type=int, default=d.max_cpu_loras, help="adapters kept resident (default: max-loras)")
    add("--max-num-seqs", type=int, default=d.max_num_seqs)
    add("--max-model-len", type=int, default=d.max_model_len)
    add("--trust-request-mm-kwargs", action="store_true", help="accept multimodal inputs")
    add("--block-size", type=int, default=d.block_size)
    add("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int,
        default=d.num_gpu_blocks, help="prefix/KV cache budget in blocks")
    add("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token, help="per uncached prompt token")
    add("--itl-ms", type=float, default=d.itl_ms, help="inter-token latency")
    add("--time-scale", type=float, default=d.time_scale, help="multiplies every delay; 0 = no delays")
    add("--default-max-tokens", type=int, default=d.default_max_tokens)
    add("--embedding-dim", type=int, default=d.embedding_dim)
    add("--lora-load-ms", type=float, default=d.lora_load_ms)
    add("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/*")
    add("--seed", type=int, default=d.seed)
    add("--uvicorn-log-level", default="warning")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        lora_modules=dict(args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        trust_request_mm_kwargs=args.trust_request_mm_kwargs,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        prefill_ms_per_token=args.prefill_ms_per_token,
        itl_ms=args.itl_ms,
        time_scale=args.time_scale,
        default_max_tokens=args.default_max_tokens,
        embedding_dim=args.embedding_dim,
        lora_load_ms=args.lora_load_ms,
        api_key=args.api_key,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.sim.app import create_app

    # vLLM serves with a 5 s keep-alive; clients' pools must expire earlier
    uvicorn.run(create_app(config_from_args(args)), host=args.host, port=args.port, loop="uvloop",
                http="httptools", log_level=args.uvicorn_log_level, timeout_keep_alive=5, access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.sim", description="Simulated vLLM replica.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
