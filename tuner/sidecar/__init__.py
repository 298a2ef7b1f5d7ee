"""The tuning service as a library: sidecar, decision scheduler, state file, actuators, sources.

Nothing here imports FastAPI or uvicorn; the HTTP surfaces live in `blocktune.tuner.serving`.
"""
