"""Helpers shared by both components: options checking, optional imports, the sync/async bridge."""
