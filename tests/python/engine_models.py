"""Small models and data shared by the engine worker (multi-process) and the single-process
reference in test_engine_parity.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 31)  # sizes odd on purpose: shards get padding
        self.fc2 = nn.Linear(31, 7)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class TinyTransformer(nn.Module):
    """2 layers, tied input/output embedding, and one frozen parameter."""

    def __init__(self, vocab=37, d=24, seq=12):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1, requires_grad=False)  # frozen
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]].to(self.tok.weight.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=self.mask.to(x.dtype), is_causal=True)
        return self.head(x)


def make_model(name):
    torch.manual_seed(1234)
    return Mlp() if name == "mlp" else TinyTransformer()


def batch(name, step, rank, micro, size=8):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + micro * 13)
    if name == "mlp":
        return torch.randn(size, 13, generator=g), torch.randn(size, 7, generator=g)
    idx = torch.randint(0, 37, (size, 12), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def loss_fn(name, out, y):
    out = out.float()
    if name == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


CONFIG = {"optimizer": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
          "loss_scale": {"initial_scale_power": 10, "window": 1000}, "gradient_clipping": 1.0,
          "reduce_bucket_numel": 500}
