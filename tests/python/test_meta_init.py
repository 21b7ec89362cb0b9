"""Models built on the meta device (zerort.engine.meta_init): initialize never holds the whole FP32
model, and the initial weights do not depend on the world size.

Memory: 8 x Linear(4096, 4096) (64 MiB of FP32 weight each, 512 MiB in all) at stage 3, W=2,
measured by zerort's counting CPU allocator from just before the model is built. Built on
the meta device the model holds 0 bytes before zerort.initialize (built on the CPU: the
whole 512 MiB). What the engine holds afterwards (master, Adam m and v, FP32 gradient shard:
16 bytes per element over W, 1 GiB here) is allocated for good; the peak may pass it only by
what initialize handles one bucket at a time: the unit being initialized and its FP32 copy
being broadcast (2 units, 128 MiB). Measured: 0 MiB above what is held, built either way
(the engine fills one bucket at a time and frees a CPU-built model's weights as it goes).
At W = 2 the states (1 GiB) outweigh the FP32 model (512 MiB); from W = 5 on the model is
the larger, and only the meta start keeps it from ever existing whole on a rank.

Values: the same seed gives bit-identical initial master weights at W = 1, 2 and 4, and at
stages 2 and 3 (each module initialized from its own seed, rank 0's values broadcast).
"""
import json
import os

import pytest
import torch

import zerort
from zerort._testing.launch import launch as launch_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "meta_init_worker.py")
pytestmark = pytest.mark.skipif(not zerort._C.with_mpi, reason="multi-rank runs use mpirun; this build has no MPI")


def launch(mode, world, tmp_path):
    out = str(tmp_path / f"{mode}{world}")
    launch_ranks("mpirun" if world > 1 else "alone", world, WORKER, mode, out, timeout=300)
    return [torch.load(f"{out}.rank{r}.pt") for r in range(world)]


def test_initialize_from_meta_never_holds_the_whole_fp32_model(tmp_path):
    mib = 2 ** 20
    for ranks in launch("memory", 2, tmp_path):
        for device, r in ranks.items():
            assert len([n for n in r["units"] if n != "persistent"]) == 8, r["units"]
            held, transient = r["after"] - r["before"], r["peak"] - r["after"]
            print(f"[meta init] built on {device}: {(r['built'] - r['before']) / mib:.1f} MiB before initialize, held "
                  f"{held / mib:.1f} MiB after it, peak {transient / mib:.1f} MiB above that (bound "
                  f"{2 * r['unit_fp32_bytes'] / mib:.0f} MiB)")
            assert held >= 4 * r["master_bytes"]  # master, m, v, gradient shard
            assert torch.isfinite(torch.tensor(r["step"]))
            assert transient <= 2 * r["unit_fp32_bytes"]
            built = r["built"] - r["before"]
            if device == "meta":
                assert built == 0
            else:  # the instrument sees the whole model when it is built for real
                assert built >= 8 * r["unit_fp32_bytes"]


def test_initial_weights_do_not_depend_on_the_world_size(tmp_path):
    ref = launch("values", 1, tmp_path)[0]
    for world in (2, 4):
        for r in launch("values", world, tmp_path):
            for stage in (2, 3):
                for k, v in ref[stage].items():
                    assert torch.equal(v, r[stage][k]), (world, stage, k)
    assert all(torch.equal(ref[2][k], ref[3][k]) for k in ref[2])


def test_a_meta_buffer_is_a_clear_error():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("scale", torch.ones(3))

    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(TypeError, match=r"buffer 'scale' is on the meta device.*include_buffers=False"):
        zerort.initialize(m, {"stage": 3, "comm": {"backend": "inprocess"}})


def _tied():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = torch.tanh(b(h))
            return self.head(h)
    return Tied


@pytest.mark.parametrize("form", ["file", "folder_with_index", "state_dict"])
def test_weights_from_safetensors_or_a_state_dict_load_bit_for_bit(tmp_path, form):
    from safetensors.torch import save_file

    Tied = _tied()
    torch.manual_seed(7)
    src = {k: v.clone() for k, v in Tied().state_dict().items() if k != "head.weight"}  # tied: saved once
    if form == "file":
        weights = str(tmp_path / "model.safetensors")
        save_file(src, weights)
    elif form == "folder_with_index":  # HuggingFace's sharded layout
        names = sorted(src)
        parts = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
        for file, keys in parts.items():
            save_file({k: src[k] for k in keys}, str(tmp_path / file))
        with open(tmp_path / "model.safetensors.index.json", "w") as f:
            json.dump({"weight_map": {k: file for file, keys in parts.items() for k in keys}}, f)
        weights = str(tmp_path)
    else:
        weights = src
    with torch.device("meta"):
        model = Tied()
    engine = zerort.initialize(model, {"stage": 3, "precision": "bf16", "comm": {"backend": "inprocess"}},
                               weights=weights)
    got = engine.full_state_dict(master=True)
    for k, v in src.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["head.weight"], src["emb.weight"])
    engine.backward(engine(torch.tensor([[1, 2, 3]])).float().sum())  # it trains
    assert not engine.step()["skipped"]


def test_weights_missing_a_parameter_name_it(tmp_path):
    Tied = _tied()
    src = {k: v for k, v in Tied().state_dict().items() if k not in ("head.weight", "blocks.1.bias")}
    with torch.device("meta"):
        model = Tied()
    with pytest.raises(zerort.ConfigError, match="no tensor named 'blocks.1.bias'"):
        zerort.initialize(model, {"stage": 3, "comm": {"backend": "inprocess"}}, weights=src)
