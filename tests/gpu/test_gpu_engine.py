"""The Python engine on a CUDA model at W = 1 over NCCL, stages 1-3 in bf16 and fp16, against
plain PyTorch on the same GPU (test_engine_parity.reference with device='cuda': the same low-precision matmuls,
an FP64 gradient sum, torch.optim.AdamW). Bounds are test_engine_parity's."""
import os

import pytest
import torch

from zerort._testing.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
from test_engine_parity import BOUND, global_rel, reference  # noqa: E402  (tests/python on sys.path)

STEPS = 20
CASES = [f"{m}:{s}:{p}:1:{STEPS}" for m in ("mlp", "transformer") for s in (1, 2, 3) for p in ("bf16", "fp16")]


def run_worker(launcher, cases, out):
    """The worker alone (NCCL with a local unique id) or under torchrun (the id through
    c10d's TCPStore). A crash prints every thread's Python stack (faulthandler)."""
    p = launch("torchrun" if launcher == "torchrun" else "alone", 1, os.path.join(HERE, "gpu_engine_worker.py"), out,
               *cases, timeout=300, env={"PYTHONFAULTHANDLER": "1"})
    assert "GPU ENGINE WORKER OK" in p.stdout
    return torch.load(f"{out}.rank0.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker("none", CASES, str(tmp_path_factory.mktemp("gpu") / "run"))


def test_torchrun_exchanges_the_unique_id_through_the_tcpstore(tmp_path):
    out = run_worker("torchrun", ["mlp:2:bf16:1:3", "mlp:1:fp16:1:3"], str(tmp_path / "run"))
    assert all(len(r["losses"]) == 3 for r in out.values())


@pytest.mark.parametrize("case", CASES)
def test_cuda_engine_matches_torch(results, case):
    ours = results[case]
    ref_losses, ref_state = reference(case, 1, device="cuda")
    worst = global_rel(ours["master"], ref_state)
    name = case.split(":")[0]
    print(f"[gpu parity {case}] max |master - reference| / max |reference| = {worst:.2e}")
    assert worst < BOUND[(name, STEPS)]
    for a, b in zip(ours["losses"], ref_losses):
        assert abs(a - b) <= 1e-2 * abs(b), (ours["losses"], ref_losses)
    assert ours["losses"][-1] < ours["losses"][0]


STAGED = [f"mlp:{s}:bf16:1:{STEPS}" for s in (1, 2, 3)] + [f"transformer:{s}:fp16:1:{STEPS}" for s in (2, 3)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_one_gpu_match_torch(tmp_path, world):
    """W ranks on one GPU over mpi, CUDA buffers staged through pinned host memory: every
    W > 1 path of the CUDA engine but NCCL, against plain PyTorch on the same GPU at W ranks
    (fp16: the dynamic loss scale's skipped steps too)."""
    import zerort

    if not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the staged W > 1 cases run under mpirun")
    out = str(tmp_path / "staged")
    launch("mpirun", world, os.path.join(HERE, "gpu_engine_worker.py"), out, "--staged", *STAGED, timeout=400)
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(world)]
    for case in STAGED:
        ref_losses, ref_state = reference(case, world, device="cuda")
        worst = global_rel(ranks[0][case]["master"], ref_state)
        print(f"[gpu parity staged W={world} {case}] max |master - reference| / max |reference| = {worst:.2e}")
        assert worst < BOUND[(case.split(":")[0], STEPS)], case
        assert all(r[case]["skipped"] == ranks[0][case]["skipped"] for r in ranks), case



HOST_TIER = [f"transformer:{s}:bf16:2:6" for s in (1, 2, 3)]


def test_optimizer_states_in_host_memory_equal_the_gpu_resident_run(tmp_path):
    """offload_optimizer "cpu" on a CUDA model (the Engine's 'cpu' tier, Note [state tiers]) at
    W = 2 staged on one GPU, and at stage 3 with the parameter shards there too (offload_param
    "cpu"): every loss and master bit equals the run with the states on the GPU."""
    import zerort

    if not zerort._C.with_mpi:
        pytest.skip("this build has no MPI; the staged W > 1 cases run under mpirun")
    out = str(tmp_path / "host")
    tiers = lambda c: ("none", "cpu", "cpu+params") if c.split(":")[1] == "3" else ("none", "cpu")
    cases = [f"{c}:{tier}" for c in HOST_TIER for tier in tiers(c)]
    launch("mpirun", 2, os.path.join(HERE, "gpu_engine_worker.py"), out, "--staged", *cases, timeout=400)
    got = torch.load(f"{out}.rank0.pt")
    for c in HOST_TIER:
        for tier in tiers(c)[1:]:
            gpu, host = got[f"{c}:none"], got[f"{c}:{tier}"]
            assert gpu["losses"] == host["losses"], (c, tier)
            assert all(torch.equal(gpu["master"][k], host["master"][k]) for k in gpu["master"]), (c, tier)

def test_nccl_bad_input_names_the_collective():
    import zerort

    comm = zerort.comm.init("nccl", timeout_s=10)  # one rank, no launcher: a local unique id
    # Gradients must be device memory: the typed error (a UsageError and a TypeError) names the tensor.
    with pytest.raises(zerort.DeviceError, match=r"^inp: tensor is on cpu, expected cuda:0"):
        comm.reduce_scatter_accumulate(torch.ones(4, dtype=torch.bfloat16), torch.empty(4, device="cuda"))
    t = torch.arange(5, dtype=torch.float32, device="cuda")
    assert torch.equal(comm.all_reduce(t), torch.arange(5, dtype=torch.float32, device="cuda"))
    flag = torch.tensor([3], dtype=torch.int64)  # a CPU control value is staged and copied back
    assert comm.all_reduce(flag, op="max").item() == 3
