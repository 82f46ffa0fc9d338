"""fce_core.arrays for torch tensors."""
import torch

from .sums import pairwise_sum

where = torch.where
stack = torch.stack
concat = torch.cat
full_like = torch.full_like
pairwise_sum = pairwise_sum


def count(mask):
    return mask.sum()


def cumsum(a):
    return a.cumsum(0)


def invert_permutation(pos):
    return torch.empty_like(pos).scatter_(0, pos, torch.arange(pos.shape[0], device=pos.device))


def f32(a):
    return a.to(torch.float32).contiguous()  # kernels read rows by pointer


def take_rows(z, idx):
    return z.gather(1, idx[:, None])[:, 0]


def pad_to(v, n):
    return torch.nn.functional.pad(v, (0, n - v.shape[0]))
