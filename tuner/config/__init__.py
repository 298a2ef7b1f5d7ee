"""Configuration: policies and their YAML files, defaults, calibrations, JSON and table helpers.

The lowest tuner layer: it imports no other tuner package.
"""
