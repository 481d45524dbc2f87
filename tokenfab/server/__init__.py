"""The OpenAI-compatible server: :class:`AsyncLLM` (engine thread), the FastAPI app, metrics and protocol.

Heavy imports (FastAPI, prometheus-client) happen when the submodules are imported, not here.
"""
