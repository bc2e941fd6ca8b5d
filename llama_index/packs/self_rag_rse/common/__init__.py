"""Helpers shared by both components: options checking, optional imports, lazy public names,
the sync/async bridge.
"""
