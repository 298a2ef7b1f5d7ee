"""blocktune: workload-adaptive block-size tuning for paged KV caches."""

__version__ = "0.1.0"
