"""kvroute: a KV-cache-aware routing gateway for LLM inference, and the engine replicas behind it.

This package holds what the gateway and the replicas share (block hashing, tokenization, the
OpenAI request schema). It must never import torch: the gateway starts without it.
"""

__version__ = "0.1.0"
