"""Fidelity: the live engine on a virtual clock, and `blocktune validate` (simulator vs engine)."""
