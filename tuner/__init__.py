"""Deciding the block size: length window, cost model, selector, policy, replay, sidecar, CLI."""
