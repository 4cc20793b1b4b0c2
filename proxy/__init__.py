"""vllm-proxy: an OpenAI-compatible routing proxy for a fleet of vLLM replicas."""

__version__ = "0.1.0"

from proxy.native import use_sources_if_stale  # noqa: E402 (before any compiled module is imported)

use_sources_if_stale()
