"""Filtering: the filter language, its compilation to Bloom / exact-plane programs, the exact forward index."""
