"""vllm-proxy: an OpenAI-compatible routing proxy for a fleet of vLLM replicas."""

__version__ = "0.1.0"
