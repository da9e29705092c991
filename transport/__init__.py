"""kvstore.transport: daemon-to-daemon block shipping, layer-pipelined, over UCX or TCP.

Receiving daemon::

    listener = Listener(TransferConfig(backend="ucx", host="10.0.0.2", port=7400), sink)
    listener.start()

Sending daemon::

    sender = Sender(TransferConfig(backend="ucx"))
    tx = sender.open("10.0.0.2:7400", keys, n_layers, chunk_bytes, deadline_s=5.0)
    for layer in range(n_layers):           # as each layer is committed
        tx.send_layer(layer, [slot_view(key, layer) for key in keys])
    tx.finish()                              # raises TransferError with a status on failure

See ``docs/transport.md`` for the wire protocol, the sink contract and measured figures.
"""

from .config import Backend, TransferConfig, UcxProgress, format_peer, parse_peer
from .listener import Listener
from .protocol import TransferError, TransferHeader, TransferStatus
from .sender import OutboundTransfer, Sender, TransferResult
from .sink import LayerProgress, MemorySink, Sink, Target

__all__ = [
    "Backend", "LayerProgress", "Listener", "MemorySink", "OutboundTransfer", "Sender", "Sink", "Target",
    "TransferConfig", "TransferError", "TransferHeader", "TransferResult", "TransferStatus",
    "UcxProgress", "format_peer", "parse_peer", "ucx_available",
]


def ucx_available() -> tuple[bool, str]:
    """Whether the UCX backend can run here, and if not, exactly why."""
    from .ucx_env import probe
    return probe()
