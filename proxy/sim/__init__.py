"""A simulated vLLM replica: same HTTP API, metrics and scheduling shape, no GPU.

Every demo, test and benchmark of the proxy runs against it; real vLLM must be a drop-in
replacement, so behaviour that the proxy can observe mimics vLLM's OpenAI server.
"""
from proxy.sim.app import SimApp, create_app
from proxy.sim.config import SimConfig

__all__ = ["SimApp", "SimConfig", "create_app"]
