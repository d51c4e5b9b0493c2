"""nanograph serve: an OpenAI-compatible HTTP server (FastAPI, uvicorn) on an async engine loop, with Prometheus
metrics. Needs the serve extra: pip install 'nanograph[serve]'."""
