"""Serving: the predictor (load a snapshot, answer requests with one forward call)."""
