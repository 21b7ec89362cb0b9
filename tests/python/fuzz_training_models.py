"""Models, data and configs built from a drawn case (a JSON-able dict), shared by the
worker (fuzz_training_worker.py, every rank) and the reference in test_fuzz_training.py.

A case's model is a chain of Linear layers (any width from 0 up, so weights of 0 elements
occur) with tanh between them, plus extra parameters of drawn shapes (scalars, 0-element,
odd sizes; some frozen) on the root module that enter the loss through tanh(p).sum()."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class FuzzModel(nn.Module):
    def __init__(self, case):
        super().__init__()
        torch.manual_seed(case["seed"])
        dims = case["dims"]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b, bias in zip(dims, dims[1:], case["bias"]))
        self.n_extras = len(case["extras"])
        for i, (shape, frozen) in enumerate(case["extras"]):
            self.register_parameter(f"extra{i}", nn.Parameter(torch.randn(shape) * 0.5, requires_grad=not frozen))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        extra = sum((torch.tanh(getattr(self, f"extra{i}")).sum().float() for i in range(self.n_extras)),
                    torch.zeros((), dtype=torch.float32))
        return x, extra


def make_batch(case, step, rank, micro):
    g = torch.Generator().manual_seed(case["seed"] * 31 + step * 7919 + rank * 104729 + micro * 13)
    dims = case["dims"]
    return torch.randn(case["batch"], dims[0], generator=g), torch.randn(case["batch"], dims[-1], generator=g)


def loss_of(output, y):
    out, extra = output
    return F.mse_loss(out.float(), y) + 0.1 * extra.float()


def engine_config(case):
    """The zerort config of a case (our keys); the reference reads its optimizer, loss-scale
    and clipping keys too."""
    return {"stage": case["stage"], "precision": case["precision"], "gradient_accumulation_steps": case["gas"],
            "reduce_bucket_numel": case["bucket"], "gradient_clipping": case["clip"],
            "optimizer": {"lr": case["lr"], "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": case["wd"]},
            "loss_scale": {"initial_scale_power": case["scale_power"], "window": 1000},
            "stage3": {"prefetch": case["prefetch"], "persistence_threshold": case["persist"]}}
