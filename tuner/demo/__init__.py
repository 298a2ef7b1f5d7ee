"""The demo: the closed loop of worker, sidecar and shifting traffic, and its chat prompts."""
