"""What a daemon registers in etcd about itself, and what it learns about its peers."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Member:
    """One registration of one daemon. ``epoch`` counts its registrations (1, 2, ...): a
    daemon whose lease ran out comes back with a higher one, and nothing addressed to an older
    epoch is served. Addresses are ``host:port`` ("" = not offered); ``namespaces`` are the
    hex ids of the namespaces it holds blocks of; ``capabilities`` says what it runs (transfer
    backend, tiers, version)."""

    node_id: str
    epoch: int
    transfer_addr: str = ""
    events_addr: str = ""
    replay_addr: str = ""
    namespaces: list[str] = field(default_factory=list)
    capabilities: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Member":
        """ValueError for a value that is not a member record (another tool's key, a newer
        format this daemon cannot read)."""
        d = json.loads(data)
        if not isinstance(d, dict) or not isinstance(d.get("node_id"), str) or not isinstance(d.get("epoch"), int):
            raise ValueError("not a kvstore member record")
        return cls(node_id=d["node_id"], epoch=d["epoch"], transfer_addr=str(d.get("transfer_addr", "")),
                   events_addr=str(d.get("events_addr", "")), replay_addr=str(d.get("replay_addr", "")),
                   namespaces=[str(n) for n in d.get("namespaces", [])], capabilities=dict(d.get("capabilities", {})))


class Change(enum.Enum):
    JOIN = "join"      # a node registered that was not there
    LEAVE = "leave"    # its key went: it left, or its lease ran out
    EPOCH = "epoch"    # it registered again with a new epoch (it had lost its lease or restarted)
    UPDATE = "update"  # same epoch, new record (namespaces, addresses)


@dataclass(frozen=True)
class MemberEvent:
    change: Change
    member: Member  # for LEAVE: the record as it was last seen
