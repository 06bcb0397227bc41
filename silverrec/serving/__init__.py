"""Serving: the predictor (load a snapshot, answer requests with one forward call) and the HTTP server
(`silverrec serve`: server.py runs app.py's routes over served.py's validated requests, batcher.py's batches)."""
