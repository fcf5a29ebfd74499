"""A token classifier whose forward reads tensor values, as Hugging Face GPT-2's does: a Python branch
on `(ids == pad).any()` and the last non-pad token's features picked with `h[arange(n), last]`
(plain tensors meeting channel-split activations). Importable by file for `hybridpar train --model`."""

import torch
from torch import nn

PAD = 0


class LastToken(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(12, dim) * 0.1)
        self.fc1 = nn.Linear(dim, 32)
        self.fc2 = nn.Linear(32, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = h + self.fc2(torch.relu(self.fc1(h)))
        if bool((ids == PAD).any()):  # data-dependent Python: meta tensors have no value to branch on
            last = ((ids != PAD).long() * torch.arange(ids.shape[1])).argmax(-1)
        else:
            last = torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long)
        return self.head(h[torch.arange(ids.shape[0]), last])


def example_ids(n: int = 4) -> torch.Tensor:
    ids = torch.randint(1, 50, (n, 12), generator=torch.Generator().manual_seed(3))
    ids[1, 8:] = PAD
    return ids


def last_token():
    torch.manual_seed(0)
    return LastToken(), (example_ids(),)
