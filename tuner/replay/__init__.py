"""Offline replay: a trace served by a simulated continuous-batching server under each policy."""
