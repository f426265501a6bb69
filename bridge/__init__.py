"""A vLLM server's sidecar: its KV events and load into kvroute's cache index (``kvroute bridge``)."""
