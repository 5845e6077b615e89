"""A GPT-2-style network for the memory, balance and init tests and for ``benchmarks/balance.py``.

Its init is GPT-2's (as in nanoGPT / build-nanogpt): ``self.apply(self._init_weights)`` draws every Linear and
Embedding from N(0, 0.02) and the residual projections from N(0, 0.02 / sqrt(2 * n_layer)); biases are zero,
LayerNorms are PyTorch's default. ``forward`` skips the units that other pipeline stages own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.c_proj.SCALE_INIT = True  # a residual projection: its std shrinks with depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.c_proj.SCALE_INIT = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Body(nn.Module):
    """Token and position embeddings, ``h`` (the blocks), final norm, untied head; PyTorch's default init (see
    :func:`gpt2_init` and :class:`GPT2` for GPT-2's)."""

    def __init__(
        self, vocab: int = 64, block_size: int = 16, n_layer: int = 4, n_head: int = 2, n_embd: int = 32
    ) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        else:
            x = idx  # a later stage receives the hidden states
        for block in self.h:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)  # (B, T, vocab)
        return x


def gpt2_init(module: nn.Module, n_layer: int = 4) -> None:
    """GPT-2's init as a free function (``net.apply(functools.partial(gpt2_init, n_layer=...))``): N(0, 0.02),
    residual projections N(0, 0.02 / sqrt(2 n_layer)), zero biases."""
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * n_layer) if getattr(module, "SCALE_INIT", False) else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


class GPT2(GPT2Body):
    """:class:`GPT2Body` with GPT-2's init as nanoGPT writes it: ``self.apply(self._init_weights)`` in ``__init__``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        gpt2_init(module, self.n_layer)
