"""The decision: the selector (heuristic, forecasts, switching rule) and one-shot recommendations.

Builds on `tuner.sim` and `tuner.config`; no HTTP, no scheduler threads, no engine.
"""
