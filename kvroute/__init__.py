"""kvroute: a KV-cache-aware routing gateway for LLM inference, and the engine replicas behind it.

This package is the shared floor: what the gateway and the replicas must agree on (``protocol``:
block hashes, Redis keys, the heartbeat; ``openai_api``; ``text``: tokenization; ``http``;
``auth``). It imports nothing above it (gateway, replica, launcher, loadtests) and never torch:
the gateway starts without it.
"""

__version__ = "0.1.0"
