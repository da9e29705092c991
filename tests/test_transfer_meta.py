"""The transfer header's meta (kvstore.daemon.transfer_meta): the namespace, with the blocks'
token ids only when every block has them, they are one chain run, and they fit the bound."""

import json

import pytest

from kvstore.daemon.index import Block
from kvstore.daemon.transfer_meta import TransferMeta, decode, encode
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.tier_kind import TierKind

NS = Namespace("m", KVLayout(2, 1, 64, "fp16", block_tokens=16), tenant_salt="t")
TOKENS = [bytes([i]) * 64 for i in range(3)]  # three blocks of 16 int32 ids
KEYS = [bytes([65 + i]) * 32 for i in range(3)]
PARENT = b"p" * 32
ALONE = json.dumps(NS.to_dict()).encode()  # the form every daemon before token ids sent


def chain(parent=PARENT, tokens=TOKENS, parents=None):
    parents = parents or [parent, *KEYS[:-1]]
    return [Block(k, NS.root, TierKind.DRAM, 0, parent_key=p, tokens=t) for k, p, t in zip(KEYS, parents, tokens)]


def test_token_ids_and_the_parent_travel_when_they_fit():
    assert decode(encode(NS, chain(), 1 << 16)) == TransferMeta(NS, PARENT, b"".join(TOKENS))
    assert decode(encode(NS, chain(parent=None), 1 << 16)) == TransferMeta(NS, b"", b"".join(TOKENS))


def test_the_namespace_goes_alone_unless_every_block_of_one_chain_run_has_tokens_that_fit():
    assert encode(NS, chain(tokens=[*TOKENS[:2], None]), 1 << 16) == ALONE
    assert encode(NS, chain(parents=[PARENT, KEYS[0], b"x" * 32]), 1 << 16) == ALONE  # two chains
    assert encode(NS, [], 1 << 16) == ALONE
    fits = len(ALONE) + 2 + 32 + 3 * 64
    assert encode(NS, chain(), fits) != ALONE
    assert encode(NS, chain(), fits - 1) == ALONE
    assert decode(ALONE) == TransferMeta(NS)


@pytest.mark.parametrize("meta,what", [(b"{}", "not a namespace: namespace.model_id: missing"),
                                       (b"\xff", "not a namespace"),
                                       (ALONE + b"\0", "parent key of no bytes"),
                                       (ALONE + b"\0\x05abcde", "parent key of 5 bytes"),
                                       (ALONE + b"\0\x00", "none sent")])
def test_malformed_meta_is_a_value_error_saying_what(meta, what):
    with pytest.raises(ValueError, match=what):
        decode(meta)
