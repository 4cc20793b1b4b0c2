"""The scale test of tests/test_discovery.py against a real cluster (kind or k3d), for where Docker
exists: streaming load through the proxy while the vLLM StatefulSet scales 2 -> 6 -> 2.

    python -m tests.k8s_scale --url http://127.0.0.1:8080 --key sim-client-key

Expects the sim overlay applied and `kubectl -n vllm-proxy port-forward svc/vllm-proxy 8080:8080`
running (deploy/README.md, "Kubernetes: the scale test on kind or k3d"). Exits 1 on any failed
request."""
from __future__ import annotations

import argparse
import subprocess
import sys

from tests.test_discovery import Load


def kubectl(namespace: str, *args: str) -> None:
    subprocess.run(["kubectl", "-n", namespace, *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--key", default="sim-client-key", help="a client key (auth.keys) of the proxy")
    parser.add_argument("--namespace", default="vllm-proxy")
    parser.add_argument("--statefulset", default="vllm")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    with Load(args.url, workers=args.workers, api_key=args.key) as load:
        load.more(50)
        for replicas in (6, 2):
            kubectl(args.namespace, "scale", f"statefulset/{args.statefulset}", f"--replicas={replicas}")
            kubectl(args.namespace, "rollout", "status", f"statefulset/{args.statefulset}", "--timeout=300s")
            load.more(200)
    print(f"{load.ok} streams, {len(load.failures)} failed")
    for failure in load.failures[:10]:
        print("  ", failure)
    return 1 if load.failures else 0


if __name__ == "__main__":
    sys.exit(main())
