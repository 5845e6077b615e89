"""The model and data both sides of the migration share: a small Llama-style decoder and byte windows of text.

The decoder follows the pattern of the hand-written pipeline tutorial (seed 000): embedding, a ``ModuleList`` of
decoder layers, a final norm and a prediction head, and a ``forward`` that skips any of them that is ``None``. That
``forward`` is the one change a model needs for pipelining, with or without lightning-pipe.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        # is_causal instead of an attention mask: a pipeline stage takes one tensor in and gives one tensor out.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class Decoder(nn.Module):
    def __init__(self, dim: int = 64, n_layers: int = 4, n_head: int = 4, block_size: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(block_size, dim)  # a module, not a bare nn.Parameter: stages own whole modules
        self.layers = nn.ModuleList(DecoderLayer(dim, n_head) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def text_windows(block_size: int = 64, count: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` consecutive (input, next-byte target) windows from the standard library's first ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    need = count * block_size + 1
    data = bytearray()
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in {"test", "tests", "idle_test", "site-packages", "__pycache__"})
        for name in sorted(files):
            if name.endswith(".py") and len(data) < need:
                data += (Path(directory) / name).read_bytes()
        if len(data) >= need:
            break
    tokens = torch.frombuffer(data[:need], dtype=torch.uint8).long()
    x = tokens[:-1].view(count, block_size)
    y = tokens[1:].view(count, block_size)
    return x, y
