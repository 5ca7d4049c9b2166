"""Utilities every layer shares: the atomic writer, the JSON sanitiser, byte units, identity maps."""
