"""Serving: the continuous-batching engine, the pure completions API, and the HTTP server."""
