"""Forwarding a routed request to its replica: ``relay`` (the body sent, the retries across
candidates, the SSE stream relayed back) over ``upstream`` (the HTTP client's connection pool) and
``connection`` (one keep-alive connection and the answer it carries)."""
