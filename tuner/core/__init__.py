"""The decision core: policy and YAML loading, calibration, measurement, cost model, selector.

No HTTP and no scheduler threads here; nothing in this package imports another tuner sub-package.
"""
