"""kvstore: tiered KV-cache daemon for LLM serving."""
__version__ = "0.1.0"
