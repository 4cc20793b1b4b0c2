"""Imports the built-in plugins, so they are registered (proxy/routing/plugins.py `lookup`)."""
from proxy.routing import filters, lora_hook, pickers, prefix_plugin, scorers  # noqa: F401
