"""The HTTP surfaces (the only place FastAPI is imported): sidecar app, worker app, closed loop."""
