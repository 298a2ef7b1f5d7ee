"""Simulation: the cost model, step costs, workloads, the serving simulator, forecasts, the window.

Builds on `tuner.config` only; pure numpy, no engine.
"""
