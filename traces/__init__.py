"""Request traces: loaders for public formats and seeded synthetic workloads."""
