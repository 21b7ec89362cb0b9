"""Small models and data shared by the engine worker (multi-process) and the single-process
reference in test_engine_parity.py: an MLP, a tiny transformer, and HuggingFace's GPT2,
Llama and Qwen2 built from small configs (no download: HF_HUB_OFFLINE=1)."""
import os

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


HF_MODELS = ("gpt2", "llama", "qwen2")
HF_VOCAB, HF_SEQ = 96, 16


def hf_model(name):
    """2 layers, hidden 32, vocab 96, no dropout. GPT2 ties its head to the token embedding
    (its default), Llama is built tied, Qwen2 untied; Llama and Qwen2 have rotary inv_freq
    buffers, and Qwen2 biases on q, k and v."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=HF_VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=HF_SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **common))
    kw = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=HF_SEQ, **common)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **kw))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **kw))


def make_model(name):
    torch.manual_seed(1234)
    if name in HF_MODELS:
        return hf_model(name)
    return Mlp() if name == "mlp" else TinyTransformer()


def model_config(name):
    """Config keys a model adds to CONFIG: none. At stage 3 the HuggingFace models get one
    unit per block from the default config (their _no_split_modules; tests/python/test_units.py)."""
    return {}


def batch(name, step, rank, micro, size=8):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + micro * 13)
    if name == "mlp":
        return torch.randn(size, 13, generator=g), torch.randn(size, 7, generator=g)
    vocab, seq = (HF_VOCAB, HF_SEQ) if name in HF_MODELS else (37, 12)
    idx = torch.randint(0, vocab, (size, seq), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def loss_fn(name, out, y):
    out = getattr(out, "logits", out).float()  # a HuggingFace model returns a ModelOutput
    if name == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


CONFIG = {"optimizer": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
          "loss_scale": {"initial_scale_power": 10, "window": 1000}, "gradient_clipping": 1.0,
          "reduce_bucket_numel": 500}
