"""The HTTP surfaces (the only place FastAPI is imported): the sidecar app and the worker app."""
