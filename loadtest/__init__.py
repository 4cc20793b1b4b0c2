"""Load tests: a very fast fake vLLM backend and the forwarding-overhead benchmark."""
