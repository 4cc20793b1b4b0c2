"""Replicas that come and go at runtime: sources (DNS, the Kubernetes API) report what they see,
and the Fleet adds, drains and removes Backends in the running proxy accordingly."""
