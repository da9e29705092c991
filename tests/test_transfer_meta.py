"""The transfer header's meta (kvstore.daemon.transfer_meta): the namespace, with the blocks'
token ids only when every block has them and they fit the header's bound."""

import json

import pytest

from kvstore.daemon.transfer_meta import TransferMeta, decode, encode
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

NS = Namespace("m", KVLayout(2, 1, 64, "fp16", block_tokens=16), tenant_salt="t")
TOKENS = [bytes([i]) * 64 for i in range(3)]  # three blocks of 16 int32 ids
PARENT = b"p" * 32


def test_token_ids_and_the_parent_travel_when_they_fit():
    assert decode(encode(NS, PARENT, TOKENS, 1 << 16)) == TransferMeta(NS, PARENT, b"".join(TOKENS))
    assert decode(encode(NS, None, TOKENS, 1 << 16)) == TransferMeta(NS, b"", b"".join(TOKENS))


def test_the_namespace_goes_alone_when_a_block_lacks_tokens_or_they_would_pass_the_bound():
    alone = json.dumps(NS.to_dict()).encode()  # the form every daemon before token ids sent
    assert encode(NS, PARENT, [*TOKENS[:2], None], 1 << 16) == alone
    assert encode(NS, PARENT, [], 1 << 16) == alone
    fits = len(alone) + 2 + 32 + 3 * 64
    assert encode(NS, PARENT, TOKENS, fits) != alone
    assert encode(NS, PARENT, TOKENS, fits - 1) == alone
    assert decode(alone) == TransferMeta(NS)


@pytest.mark.parametrize("meta,what", [(b"{}", "not a namespace: namespace.model_id: missing"),
                                       (b"\xff", "not a namespace"),
                                       (json.dumps(NS.to_dict()).encode() + b"\0", "parent key of no bytes"),
                                       (json.dumps(NS.to_dict()).encode() + b"\0\x05abcde", "parent key of 5 bytes"),
                                       (json.dumps(NS.to_dict()).encode() + b"\0\x00", "none sent")])
def test_malformed_meta_is_a_value_error_saying_what(meta, what):
    with pytest.raises(ValueError, match=what):
        decode(meta)
