"""Clients for inference workers: :class:`KVStoreClient` and engine adapters."""

from kvstore.clients.client import KVStoreClient, KVStoreError, ReadLease, WriteLease

__all__ = ["KVStoreClient", "KVStoreError", "ReadLease", "WriteLease"]
