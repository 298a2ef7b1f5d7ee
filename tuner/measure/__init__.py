"""Measurement: the modules that drive the runtime and kernels to calibrate step and kernel costs.

Builds on `tuner.config`; the only tuner layer below the decision that imports runtime and kernels.
"""
