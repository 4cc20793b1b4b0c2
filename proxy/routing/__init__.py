"""Routing: which replicas may serve a request and which one does.

catalog (deployments -> replicas), backends (live replica state), and the framework: plugins
(the parts and their registry), filters, scorers, pickers, hooks (lora_hook), prefix_plugin
(prefix_affinity: affinity, index, packing), profiles (YAML compositions, the built-in
policies), scheduler (runs a profile, hands out leases), clock."""
