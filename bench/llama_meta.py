"""A Llama-shaped model for bench/gpu_offload.py: RMSNorm, attention with rotary positions (computed in
forward, so the model has no buffers and builds on the meta device), a SwiGLU MLP. Built under
torch.device("meta") it takes no memory; zerort makes it real unit by unit (one unit per Block), and
DeepSpeed's rows take it to the GPU with to_empty and init_in_place.
"""
import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def rotary(x, base=10000.0):
    """x (batch, heads, seq, dim) rotated by its position (no buffers: a meta model has none to fill)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class Block(torch.nn.Module):
    """Attention (no bias, rotary, causal) and a SwiGLU MLP, each after an RMSNorm: a Llama block."""

    def __init__(self, hidden, heads, intermediate):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, layers, hidden, heads, intermediate, vocab, **_):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads, intermediate) for _ in range(layers))
        self.norm, self.head = RMSNorm(hidden), torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def init_in_place(model):
    """Values for a model taken off the meta device with to_empty: each module's own reset_parameters."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
