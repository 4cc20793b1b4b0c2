"""Cost of the one parse pass on text-only bodies, this tree vs an older parse module.

    python -m loadtest.parse_cost [--baseline path/to/old/parse.py]

Shows that multimodal detection (done in the same pass) costs text-only traffic nothing
measurable: the same bodies through both parsers, interleaved, medians of many repetitions.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import orjson

from proxy import parse

BODIES = {
    "short chat": {"model": "m", "messages": [{"role": "user", "content": "Hello there!"}], "max_tokens": 16},
    "multi-turn chat": {"model": "m", "messages": [
        {"role": "system", "content": "You are helpful. " * 100},
        *({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 20} for i in range(10))]},
    "chat, text parts": {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]},
    "completion": {"model": "m", "prompt": "Once upon a time " * 50, "max_tokens": 16},
}


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_parse", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_parse"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def per_call_us(module, endpoint: str, body: bytes, n: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        module.parse_request(endpoint, body)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", required=True, help="an older proxy/parse.py (e.g. from git show)")
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    old = load(args.baseline)
    print(f"{'body':<18} {'baseline µs':>12} {'current µs':>11} {'ratio':>6}")
    for name, data in BODIES.items():
        endpoint = parse.COMPLETIONS if "prompt" in data else parse.CHAT
        body = orjson.dumps(data)
        base, cur = [], []
        for _ in range(args.rounds):
            base.append(per_call_us(old, endpoint, body))
            cur.append(per_call_us(parse, endpoint, body))
        b, c = statistics.median(base), statistics.median(cur)
        print(f"{name:<18} {b:>12.2f} {c:>11.2f} {c / b:>6.2f}")


if __name__ == "__main__":
    main()
