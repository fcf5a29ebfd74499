"""The per-step finiteness check (train_loop._finite_here): exact per entry, one device sync for all
tensors, no false alarm where a sum of finite values overflows (the old per-tensor sum test's flaw)."""

import torch

from hybridpar.runtime.train_loop import _finite_here


def test_nan_and_inf_anywhere_are_found_and_large_finite_values_are_not():
    ok = [torch.randn(3, 4), torch.tensor([3e38, 3e38]), torch.ones(2, dtype=torch.bfloat16), torch.empty(0)]
    assert _finite_here(ok)  # 3e38 + 3e38 overflows a sum, not a max |entry|
    assert _finite_here([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(5)
        t[3] = bad
        assert not _finite_here([*ok, t])


def test_sparse_gradients_are_checked_by_their_values():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse and _finite_here([emb.weight.grad])
    emb.weight.grad = torch.sparse_coo_tensor([[1]], torch.full((1, 4), float("nan")), (10, 4))
    assert not _finite_here([emb.weight.grad])
