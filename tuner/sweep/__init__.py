"""What-if sweeps on Dask: traces x policies x a grid of settings, each a replay as tasks.

The only package that imports Dask; `blocktune replay --jobs` runs its policies
through the same executor (`blocktune.tuner.sweep.executor`).
"""
