"""The Python engine (zerort.initialize) in real multi-process runs against plain PyTorch.

Reference: one process, the same model with an FP32 master, low-precision compute emulated
by casting a copy of the master to bf16/fp16 for forward and backward, the mean gradient
over every rank's micro-batch (summed in FP64), torch.nn.utils.clip_grad_norm_ and
torch.optim.AdamW(foreach=False).

Tolerance: both sides compute the same low-precision gradients from the same low-precision
weights; they differ only in how the FP32 gradient sum, the clip norm and the AdamW update
are rounded (~1e-7 relative per step). Measured and bounded, relative to the largest
parameter of the model:
- one step, any model: measured 5e-10 to 4e-9; bound 1e-6.
- 20 steps of the MLP: measured 1e-8 (bf16, fp16) and 1e-7 (fp32); bound 1e-5.
- 20 steps of the transformer: measured 9.8e-4 (bf16) and 5.0e-3 (fp16); 1.2e-2 while the
  reference rounded the LayerNorm weights through bf16 at every step. Bound 2e-2. Its
  attention key biases have a true gradient of zero (softmax ignores a constant added to
  every key), so their gradient is pure rounding noise, which Adam normalises into full
  steps of +-lr. Once the two sides' noise differs, such a parameter can drift by up to
  steps x lr = 20 x 3e-3 = 0.06, which is 1.8e-2 of the largest parameter (3.35); 2e-2
  rounds that up.
- per-step mean loss: measured 2e-4 relative; bound 1e-2.
"""
import copy
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import CONFIG, batch, loss_fn, make_model, model_config  # noqa: E402

import zerort  # noqa: E402
from zerort._testing.launch import launch as launch_ranks  # noqa: E402

WORKER = os.path.join(HERE, "engine_worker.py")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STEPS = 20
PARITY_CASES = ([f"{m}:{s}:{p}:1:{STEPS}"
                 for m in ("mlp", "transformer") for s in (0, 1, 2, 3) for p in ("bf16", "fp16")]
                + [f"transformer:{s}:{p}:1:1" for s in (0, 2, 3) for p in ("bf16", "fp16", "fp32")]
                + [f"mlp:{s}:fp32:1:{STEPS}" for s in (0, 3)])
# Without clipping the three stages must agree bit for bit. (With clipping, stage 3 sums
# the squares for the norm in another element order, so the clip factor can differ in its
# last bit; see test_stage1_equals_stage2_bitwise for stages 1 and 2 with clipping.)
DETERMINISM_CASES = [f"{m}:{s}:bf16:1:8:noclip" for m in ("mlp", "transformer") for s in (0, 1, 2, 3)]
BOUND = {("mlp", STEPS): 1e-5, ("transformer", STEPS): 2e-2, ("transformer", 1): 1e-6}
OVERFLOW_CASE = "mlp:2:fp16:1:8:inf@3"


def launch(kind, nranks, cases, tmp_path, staged=None):
    prefix = str(tmp_path / f"{kind}{nranks}{staged or ''}")
    if staged:
        cases = ["--staged", staged, *cases]
    launch_ranks(kind, nranks, WORKER, prefix, *cases, timeout=600)
    return [torch.load(f"{prefix}.rank{r}.pt") for r in range(nranks)]


def reference(case, world, device="cpu"):
    """Plain PyTorch on `device` (tests/gpu runs it on the GPU, so both sides share the
    GPU's low-precision matmuls)."""
    name, stage, precision, gas, steps = case.split(":")[:5]
    gas, steps = int(gas), int(steps)
    dtype = DTYPES[precision]
    model = make_model(name).to(device)
    opt_cfg = CONFIG["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]), eps=opt_cfg["eps"],
                            weight_decay=opt_cfg["weight_decay"], foreach=False)
    scale = 2.0 ** CONFIG["loss_scale"]["initial_scale_power"] if precision == "fp16" else 1.0
    losses = []
    for step in range(steps):
        low = _low_precision_copy(model, dtype)
        sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]  # on device
        total = 0.0
        for r in range(world):
            for micro in range(gas):
                x, y = (t.to(device) for t in batch(name, step, r, micro))
                x = x.to(dtype) if x.is_floating_point() else x
                loss = loss_fn(name, low(x), y)
                low.zero_grad(set_to_none=True)
                (loss * scale).backward()
                for s, p in zip(sums, [q for q in low.parameters() if q.requires_grad]):
                    if p.grad is not None:
                        s += p.grad.double()
                total += loss.item() / gas
        losses.append(total / world)
        for p, s in zip(params, sums):
            p.grad = (s / (scale * world * gas)).float()
        torch.nn.utils.clip_grad_norm_(params, CONFIG["gradient_clipping"])
        opt.step()
    return losses, {k: v.detach().float().cpu() for k, v in model.named_parameters(remove_duplicate=False)}


def _low_precision_copy(model, dtype):
    """The model cast to dtype, except what zerort keeps FP32 (zerort.layout.precision's rule,
    written out for the test models): norm layers (torch's LayerNorm, HuggingFace's
    *RMSNorm) keep their FP32 values and compute in FP32, inputs cast to FP32 and outputs
    back; the float buffers of modules without parameters (HF's rotary inv_freq) keep their
    FP32 values. Other float buffers are cast with their module's parameters."""
    low = copy.deepcopy(model)
    for m, original in zip(low.modules(), model.modules()):
        if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("RMSNorm"):
            m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
            m.register_forward_hook(lambda mod, args, out: out.to(dtype))
            continue
        for p in m.parameters(recurse=False):
            p.data = p.data.to(dtype)
        if next(original.parameters(), None) is not None:
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.to(dtype))
    return low


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def global_rel(ours, ref):
    """Largest difference over the model, relative to the model's largest parameter."""
    diff = max((ours[k].double() - ref[k].double()).abs().max().item() for k in ref)
    return diff / max(ref[k].abs().max().item() for k in ref)


@pytest.fixture(scope="module")
def mpirun2(tmp_path_factory):
    if not zerort._C.with_mpi:
        pytest.skip("MPI is optional at build time and this build has none; these cases run under mpirun")
    return launch("mpirun", 2, PARITY_CASES + DETERMINISM_CASES + [OVERFLOW_CASE], tmp_path_factory.mktemp("mpi2"))


@pytest.mark.parametrize("case", PARITY_CASES)
def test_parity_w2_mpirun(mpirun2, case):
    ranks = [r[case] for r in mpirun2]
    ref_losses, ref_state = reference(case, 2)
    for r in ranks[1:]:  # every rank ends with the same parameters
        for k in r["params"]:
            assert torch.equal(r["params"][k], ranks[0]["params"][k]), k
    worst = global_rel(ranks[0]["master"], ref_state)
    name, steps = case.split(":")[0], int(case.split(":")[4])
    print(f"[parity {case}] max |master - reference| / max |reference| = {worst:.2e}")
    assert worst < BOUND[(name, steps)]
    for a, b in zip(ranks[0]["losses"], ref_losses):
        assert abs(a - b) <= 1e-2 * abs(b), (ranks[0]["losses"], ref_losses)
    if steps > 1:
        assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_stage1_equals_stage2_bitwise(mpirun2, model, precision):
    one = mpirun2[0][f"{model}:1:{precision}:1:{STEPS}"]["master"]
    two = mpirun2[0][f"{model}:2:{precision}:1:{STEPS}"]["master"]
    for k in one:
        assert torch.equal(one[k], two[k]), k


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_stages_0_1_2_3_bitwise_without_clipping(mpirun2, model):
    runs = [mpirun2[0][f"{model}:{s}:bf16:1:8:noclip"]["master"] for s in (0, 1, 2, 3)]
    for k in runs[0]:
        assert all(torch.equal(runs[0][k], r[k]) for r in runs[1:]), k


def test_fp32_modules_keep_fp32_parameters():
    model = make_model("transformer")
    zerort.initialize(model, dict(CONFIG, stage=2, precision="bf16", comm={"backend": "inprocess"}))
    for name, p in model.named_parameters():
        want = torch.float32 if "norm" in name else torch.bfloat16
        assert p.dtype == want, (name, p.dtype)


def test_fp16_overflow_on_one_rank_skips_everywhere(mpirun2):
    r0, r1 = mpirun2[0][OVERFLOW_CASE], mpirun2[1][OVERFLOW_CASE]
    assert r0["skipped"] == r1["skipped"] == [s == 3 for s in range(8)]
    assert r0["scales"] == r1["scales"]


STAGED_CASES = [f"mlp:{s}:bf16:1:{STEPS}" for s in (1, 2, 3)] + ["transformer:3:fp16:1:1", OVERFLOW_CASE]


def test_host_staged_path_equals_the_direct_one(mpirun2, tmp_path):
    """The staging a CUDA model takes over mpi or gloo (ranks sharing one GPU), with CPU
    buffers: every collective through host staging buffers and back. The same bits as the
    direct path at W = 2 under mpirun, and under torchrun (gloo), and the overflow step is
    skipped alike; W = 4 against plain torch."""
    runs = [("mpirun", 2), ("torchrun", 2)] if zerort._C.with_mpi else [("torchrun", 2)]
    for kind, n in runs:
        staged = launch(kind, n, STAGED_CASES, tmp_path, staged="cpu")
        for case in STAGED_CASES:
            for r in range(n):
                for k, v in mpirun2[r][case]["master"].items():
                    assert torch.equal(staged[r][case]["master"][k], v), (kind, case, r, k)
                assert staged[r][case]["losses"] == mpirun2[r][case]["losses"], (kind, case)
                assert staged[r][case]["skipped"] == mpirun2[r][case]["skipped"], (kind, case)
    if zerort._C.with_mpi:
        case4 = f"mlp:3:bf16:1:{STEPS}"
        w4 = launch("mpirun", 4, [case4], tmp_path, staged="cpu")
        _, ref_state = reference(case4, 4)
        assert global_rel(w4[0][case4]["master"], ref_state) < BOUND[("mlp", STEPS)]


def test_torchrun_gloo_and_w4(tmp_path):
    cases = ["transformer:2:bf16:1:1", "transformer:3:bf16:1:1", f"mlp:1:fp16:1:{STEPS}", f"mlp:3:bf16:1:{STEPS}"]
    gloo = launch("torchrun", 2, cases, tmp_path)
    for case in cases:
        _, ref_state = reference(case, 2)
        name, steps = case.split(":")[0], int(case.split(":")[4])
        assert global_rel(gloo[0][case]["master"], ref_state) < BOUND[(name, steps)], case
    if zerort._C.with_mpi:
        case4 = f"mlp:3:bf16:1:{STEPS}"
        w4 = launch("mpirun", 4, [case4] + MEMORY_W4_CASES, tmp_path)
        _, ref_state = reference(case4, 4)
        assert global_rel(w4[0][case4]["master"], ref_state) < BOUND[("mlp", STEPS)]
        check_memory(w4, MEMORY_W4_CASES + [case4], 4)


MEMORY_W4_CASES = [f"{m}:{s}:bf16:1:2" for m in ("mlp", "transformer") for s in (1, 2, 3)]


def check_memory(results, cases, world):
    """Every rank's measured bytes equal the exact estimate of zerort.estimate_memory for a
    fresh copy of the model, to the byte (the gathered stage-3 units: within the bound)."""
    from zerort.config import parse

    for case in cases:
        name, stage, precision = case.split(":")[0], int(case.split(":")[1]), case.split(":")[2]
        cfg = parse(dict(CONFIG, **model_config(name), stage=stage, precision=precision))
        est = zerort.estimate_memory(make_model(name), world, stage, precision,
                                     reduce_bucket_numel=cfg.reduce_bucket_numel, config=cfg)["exact"]
        for r, res in enumerate(results):
            rows = res[case]["memory"]["categories"]
            for k, row in rows.items():
                if row["bound_only"]:
                    assert row["measured"] <= est[k], (case, r, k, row["measured"], est[k])
                else:
                    assert row["measured"] == est[k], (case, r, k, row["measured"], est[k])
                assert row["estimate"] == est[k], (case, k)


def test_memory_report_equals_exact_estimate_w2(mpirun2):
    cases = [c for c in PARITY_CASES if c.endswith(f":1:{STEPS}") and c.split(":")[2] != "fp32"]
    check_memory(mpirun2, cases, 2)


def test_memory_report_equals_exact_estimate_w1():
    from zerort.config import parse

    for name in ("mlp", "transformer"):
        for stage in (0, 1, 2, 3):
            cfg = dict(CONFIG, stage=stage, precision="bf16", comm={"backend": "inprocess"})
            e = zerort.initialize(make_model(name), cfg)
            x, y = batch(name, 0, 0, 0)
            e.backward(loss_fn(name, e(x), y))
            e.step()
            res = {"c": {"memory": e.memory_report().to_dict()}}
            check_memory([res], [], 1)  # shape check of the helper
            est = zerort.estimate_memory(make_model(name), 1, stage, "bf16", reduce_bucket_numel=500,
                                         config=parse(dict(CONFIG, stage=stage)))["exact"]
            for k, row in res["c"]["memory"]["categories"].items():
                if row["bound_only"]:
                    assert row["measured"] <= est[k], (name, stage, k)
                else:
                    assert row["measured"] == est[k], (name, stage, k, row["measured"], est[k])


def test_gradient_accumulation_equals_concatenated_batch():
    # One process: 4 micro-steps of 8 samples vs one step on the 32 concatenated samples.
    steps, lr = 5, CONFIG["optimizer"]["lr"]

    def train(gas):
        model = make_model("mlp")
        cfg = dict(CONFIG, stage=2, precision="bf16", gradient_accumulation_steps=gas,
                   comm={"backend": "inprocess"})
        engine = zerort.initialize(model, cfg)
        norms, losses = [], []
        for step in range(steps):
            xs, ys = zip(*(batch("mlp", step, 0, m, size=8) for m in range(4)))
            if gas == 1:
                xs, ys = [torch.cat(xs)], [torch.cat(ys)]
            total = 0.0
            for x, y in zip(xs, ys):
                loss = loss_fn("mlp", engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / len(xs)
            norms.append(engine.stats["grad_norm"])
            losses.append(total)
        return engine.full_state_dict(master=True), norms, losses

    (a, norm_a, loss_a), (b, norm_b, loss_b) = train(4), train(1)
    # The averaged gradient is the same up to bf16 rounding of the per-sample work (2^-8).
    for x, y in zip(norm_a + loss_a, norm_b + loss_b):
        assert abs(x - y) <= 1e-2 * abs(y), (norm_a, norm_b, loss_a, loss_b)
    # Adam's first steps are nearly sign(g) * lr, so an element whose gradient is near zero
    # can step the other way under that rounding: at most 2 * lr per step apart.
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 2 * lr * steps, diff


def test_bad_engine_config_names_the_key():
    with pytest.raises(zerort.config.ConfigError, match="stage: got 5; allowed: >= 0 and <= 3"):
        zerort.initialize(make_model("mlp"), {"stage": 5, "comm": {"backend": "inprocess"}})
    with pytest.raises(zerort.config.ConfigError, match="comm.backend: got 'nccl'"):
        zerort.initialize(make_model("mlp"), {"comm": {"backend": "nccl"}})
    with pytest.raises(zerort.config.ConfigError, match="bf16.enabled and fp16.enabled: both true"):
        zerort.initialize(make_model("mlp"), {"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(zerort.config.ConfigError, match=r"zero_optimization.offload_param.device: got 'nvme' with "
                                                         "offload_optimizer.device 'none'; .* set "
                                                         "zero_optimization.offload_optimizer.device to 'nvme'"):
        zerort.initialize(make_model("mlp"), {"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": "/nvme"}}})
    with pytest.raises(zerort.config.ConfigError, match="optimizer.lr: got -0.1"):
        zerort.initialize(make_model("mlp"), {"optimizer": {"lr": -0.1}})


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, ckpt):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if ckpt else b(x)
        return self.out(x)


def test_stage3_with_activation_checkpointing_equals_stage2():
    # Recomputation runs a unit's forward again inside backward: the unit must stay
    # gathered, and no prefetch of pre-update values may survive the optimizer step.
    import torch.utils.checkpoint  # noqa: F401

    def run(stage, ckpt):
        e = zerort.initialize(_Checkpointed(), dict(CONFIG, stage=stage, precision="bf16", gradient_clipping=0.0,
                                                    comm={"backend": "inprocess"}))
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            e.backward(torch.nn.functional.mse_loss(e(x, ckpt=ckpt).float(), y))
            e.step()
        return e.full_state_dict(master=True)

    a, b = run(2, False), run(3, True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
