"""The replica: a PyTorch engine serving one model behind an OpenAI-compatible HTTP server."""
