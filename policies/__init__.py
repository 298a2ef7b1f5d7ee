"""The bundled policy files, shipped as package data (`--policy NAME` finds them by stem)."""
