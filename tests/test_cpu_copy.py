"""The C strided copies (tiers/_kvcopy.c through kvstore.tiers.cpu_copy): every item's bytes
as torch's copy_ moves them, whatever the dims' order, strides and element size, and nothing
outside the buffers a caller names."""

import itertools

import numpy as np
import pytest
import torch

from kvstore.tiers.cpu_copy import BlockCopy, ItemCopy, native


def test_the_library_is_built_by_make_test():
    assert native() is not None, "tiers/_kvcopy.so missing: scripts/build_kvcodec.sh builds it"


DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))), ids=str)
def test_items_copy_as_torch_does(dtype, perm):
    """Items of [heads, tokens, dim]: the source permuted (a transposed K page among them), the
    destination a column slice of a wider row, at scattered base addresses."""
    g = torch.Generator().manual_seed(sum(perm))
    shape = (3, 8, 12)
    n = 5
    src_all = torch.randint(0, 255, (n, *[shape[p] for p in perm]), generator=g, dtype=torch.uint8).to(dtype)
    inv = [perm.index(k) for k in range(3)]
    src = [src_all[j].permute(*inv) for j in range(n)]  # logical [heads, tokens, dim]
    dst_all = torch.zeros(2 * n, shape[0], shape[1], shape[2] + 4, dtype=dtype)
    order = [2 * (n - 1 - j) + 1 for j in range(n)]  # backwards, every other one
    dst = [dst_all[k, :, :, 2:2 + shape[2]] for k in order]
    copy = ItemCopy.of(dst[0], src[0])
    copy.run(np.array([d.data_ptr() for d in dst]), np.array([s.data_ptr() for s in src]))
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    untouched = torch.ones(2 * n, dtype=torch.bool)
    untouched[order] = False
    assert not dst_all[untouched].any() and not dst_all[..., :2].any() and not dst_all[..., 2 + shape[2]:].any()


def test_dense_dims_merge_into_one_memcpy():
    a = torch.zeros(4, 16, 64)
    assert ItemCopy.of(a, torch.zeros(4, 16, 64)).shape == [4 * 16 * 64]
    t = torch.zeros(4, 64, 16).transpose(1, 2)  # a transposed K page
    c = ItemCopy.of(t, a)
    assert c.shape == [4, 64, 16] and c.ds == [64 * 16 * 4, 16 * 4, 4] and c.ss == [16 * 64 * 4, 4, 64 * 4]


def test_mismatched_items_are_refused():
    with pytest.raises(ValueError, match="items"):
        ItemCopy.of(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="items"):
        ItemCopy.of(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64))
    c = ItemCopy.of(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        c.run(np.zeros(2, np.int64), np.zeros(1, np.int64))


class _Pages:
    """What BlockCopy.check reads of a PagedKV: the kernel block count of layer 0's first half."""

    def __init__(self, kblocks: int) -> None:
        self.pages = [type("P", (), {"halves": (torch.zeros(kblocks, 1, 1, 1),)})()]


def test_addresses_outside_the_buffers_are_refused_before_any_copy():
    arena = torch.zeros(10 * 64, dtype=torch.uint8)
    b = BlockCopy(_Pages(4), None, arena, 64)
    b.check(torch.tensor([[0], [3]]), np.array([0, 9 * 64]))  # the last slot and kernel block fit
    with pytest.raises(ValueError, match="outside the 640-byte arena"):
        b.check(torch.tensor([[0]]), np.array([9 * 64 + 1]))
    with pytest.raises(ValueError, match="outside the 640-byte arena"):
        b.check(torch.tensor([[0]]), np.array([-64]))
    with pytest.raises(ValueError, match=r"kernel blocks \[0, 4\] outside the cache's 4"):
        b.check(torch.tensor([[0], [4]]), np.array([0, 64]))


def test_threads_split_the_items():
    src = torch.randn(37, 4, 32, 16)
    dst = torch.zeros(37, 4, 16, 32).transpose(2, 3)
    ItemCopy.of(dst[0], src[0], threads=4).run(np.array([d.data_ptr() for d in dst]),
                                                np.array([s.data_ptr() for s in src]))
    assert torch.equal(dst, src)


def test_more_groups_than_one_call_takes_go_in_several():
    from kvstore.tiers.cpu_copy import MAX_GROUPS, copy_groups
    src = torch.randn(MAX_GROUPS + 3, 4, 8)
    dst = torch.zeros(MAX_GROUPS + 3, 8, 4).transpose(1, 2)
    c = ItemCopy.of(dst[0], src[0])
    copy_groups([(c, [d.data_ptr()], [s.data_ptr()]) for d, s in zip(dst, src)], threads=2)
    assert torch.equal(dst, src)
