"""Routing: which replicas may serve a request (catalog, filters) and which one does (policies)."""
