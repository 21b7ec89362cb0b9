"""zerort's counting CPU allocator (zerort._C) and the per-phase helper (zerort.accounting.memory.Phases).

Installing it is for the whole process, as zerort.initialize does; what must happen before
installation runs in a subprocess."""
import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import zerort
from zerort import _C
from zerort.accounting import memory

MIB = 1 << 20


@pytest.fixture(autouse=True)
def installed():
    assert _C.install_counting_allocator()
    gc.collect()  # no tensor of an earlier test is freed in the middle of a count
    gc.disable()
    yield
    gc.enable()


def current():
    return _C.allocator_stats()["current"]


def test_install_is_idempotent_and_stats_are_a_dict():
    assert _C.install_counting_allocator() is True
    s = _C.allocator_stats()
    assert set(s) == {"current", "peak"} and 0 <= s["current"] <= s["peak"]


def test_a_tensor_is_counted_exactly_and_the_peak_stays():
    base = current()
    _C.reset_allocator_peak()
    assert _C.allocator_stats()["peak"] == base
    t = torch.empty(64 * MIB, dtype=torch.uint8)
    assert _C.allocator_stats() == {"current": base + 64 * MIB, "peak": base + 64 * MIB}
    del t
    assert _C.allocator_stats() == {"current": base, "peak": base + 64 * MIB}
    _C.reset_allocator_peak()
    assert _C.allocator_stats() == {"current": base, "peak": base}
    empty = torch.empty(0)  # no memory, no count
    assert current() == base
    del empty


def test_storage_resize_goes_through_the_allocator():
    base = current()
    t = torch.randn(4 * MIB // 4)  # 4 MiB of float32
    view = t[1:].view(-1, 3)       # what autograd saves holds the same storage
    s = t.untyped_storage()
    assert current() == base + 4 * MIB
    s.resize_(0)
    assert current() == base and s.nbytes() == 0
    s.resize_(4 * MIB)
    assert current() == base + 4 * MIB
    t.fill_(2.0)  # the refilled storage is the one the view reads
    assert torch.equal(view, torch.full_like(view, 2.0))
    s.resize_(MIB)  # shrinking reallocates too: only the new size is live
    assert current() == base + MIB
    del t, view, s
    assert current() == base


def test_saved_weight_freed_by_resize_and_refilled_for_backward():
    """The stage-3 way to release a gathered unit whatever autograd saved (as FSDP2 does)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256, requires_grad=True)
    ref_w = lin.weight.detach().clone()
    y = lin(x)
    storage, nbytes = lin.weight.untyped_storage(), lin.weight.untyped_storage().nbytes()
    before = current()
    storage.resize_(0)  # the weight autograd saved has no memory now
    assert current() == before - nbytes
    storage.resize_(nbytes)
    # "Gathered again" through a second tensor over the same storage: it has its own version
    # counter, so the weight autograd saved stays at the version it recorded (a copy_ into
    # lin.weight itself would bump it and fail the backward).
    torch.empty(0).set_(storage, 0, ref_w.shape).copy_(ref_w)
    y.sum().backward()
    expect_gx = torch.ones(8, 256) @ ref_w
    torch.testing.assert_close(x.grad, expect_gx)
    torch.testing.assert_close(lin.weight.grad, torch.ones(8, 256).t() @ x.detach())


def test_mark_counts_what_is_allocated_after_it_and_kept():
    """What zerort.initialize measures the engine's holdings with: the model's tensors it
    frees do not hide what it allocates."""
    old = torch.empty(4 * MIB, dtype=torch.uint8)
    _C.mark_allocator()
    assert _C.allocator_since_mark() == 0
    kept = torch.empty(MIB, dtype=torch.uint8)
    tmp = torch.empty(2 * MIB, dtype=torch.uint8)
    del tmp, old
    assert _C.allocator_since_mark() == MIB
    assert _C.allocated_since_mark(kept) and _C.allocated_since_mark(kept[1:].view(-1, 3))
    _C.mark_allocator()
    assert not _C.allocated_since_mark(kept) and not _C.allocated_since_mark(torch.empty(0))
    del kept
    assert _C.allocator_since_mark() == 0


def mlp_step(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    x, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    torch.nn.functional.cross_entropy(model(x), target).backward()
    ref = [p.detach().double().requires_grad_() for p in model.parameters()]
    h = torch.nn.functional.gelu(x.double() @ ref[0].t() + ref[1])
    torch.nn.functional.cross_entropy(h @ ref[2].t() + ref[3], target).backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r.grad.float(), rtol=1e-5, atol=1e-6)


def test_torch_ops_are_correct_and_leave_nothing_behind():
    a, b = torch.randn(300, 200), torch.randn(200, 100)
    torch.testing.assert_close(a @ b, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-4)
    del a, b
    mlp_step(0)  # warm-up: torch may keep caches from a first call
    base = current()
    mlp_step(1)
    assert current() == base


def test_many_threads_balance():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        (x @ x).sum()  # warm-up
        base = current()
        _C.reset_allocator_peak()
        errors = []

        def work(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                for _ in range(20):
                    a = torch.randn(512, 512, generator=g)
                    b = (a @ a).relu_() + torch.cat([a, a]).sum(0)
                    del a, b
                    chunks = [torch.empty(int(torch.randint(1, 1 << 16, (1,), generator=g))) for _ in range(50)]
                    del chunks
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not errors
        del x
        s = _C.allocator_stats()
        assert s["current"] == base - 512 * 512 * 4
        assert s["peak"] >= base + 4 * 512 * 512 * 4  # a, a @ a and the cat of one thread at least
    finally:
        torch.set_num_threads(threads)


def test_phases_record_peak_growth_and_nesting():
    phases = memory.Phases("cpu")
    with phases("step"):
        with phases("forward"):
            a = torch.empty(8 * MIB, dtype=torch.uint8)
            del a
            kept = torch.empty(4 * MIB, dtype=torch.uint8)
        memory.reset_peak()  # a reset inside an open phase does not lose its peak
        with phases("backward"):
            b = torch.empty(2 * MIB, dtype=torch.uint8)
            del b
    f, bw, st = phases.result["forward"], phases.result["backward"], phases.result["step"]
    assert f.growth == 8 * MIB and f.end - f.start == 4 * MIB and f.calls == 1
    assert bw.growth == 2 * MIB and bw.start == f.end
    assert st.growth == 8 * MIB and st.peak == f.peak and st.end == bw.end
    with phases("forward"):  # a second call: the largest growth stays, start/end are the last
        c = torch.empty(MIB, dtype=torch.uint8)
        del c
    second = phases.result["forward"]
    assert second.growth == 8 * MIB and second.calls == 2
    assert second.last_peak == second.start + MIB and second.peak == f.peak  # the last call's own peak
    assert set(phases.to_dict()["forward"]) == {"start", "peak", "end", "growth", "calls", "last_peak"}
    del kept


def test_phases_begin_end_from_hooks_and_misuse():
    phases = memory.Phases()
    phases.begin("forward")
    with pytest.raises(RuntimeError, match="already open"):
        phases.begin("forward")
    t = torch.empty(MIB, dtype=torch.uint8)
    assert phases.end("forward").growth == MIB
    with pytest.raises(RuntimeError, match="not open"):
        phases.end("forward")
    with pytest.raises(zerort.DeviceError, match="'cpu' or 'cuda'"):
        memory.Phases("meta")
    assert memory.allocated("cpu")[0] == current()
    del t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_phases_on_cuda_use_torch_statistics():
    phases = memory.Phases("cuda")
    with phases("forward"):
        t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        del t
    assert phases.result["forward"].growth == 64 * MIB


BEFORE_INSTALL = textwrap.dedent("""
    import torch, zerort
    from zerort import _C
    MIB = 1 << 20
    try:
        _C.allocator_stats()
        raise SystemExit("allocator_stats before install did not raise")
    except zerort.Error as e:
        assert "not installed" in str(e), e
    old = [torch.ones(MIB) for _ in range(8)]       # made through torch's own allocator
    old_storage = torch.ones(MIB).untyped_storage()
    assert _C.install_counting_allocator()
    base = _C.allocator_stats()["current"]
    for t in old:
        t.add_(1)
    del old, t
    old_storage.resize_(0)                          # still through the old allocator
    old_storage.resize_(2 * MIB)
    assert _C.allocator_stats()["current"] == base, _C.allocator_stats()
    new = torch.ones(MIB)
    assert _C.allocator_stats()["current"] == base + 4 * MIB
    del new, old_storage
    assert _C.allocator_stats()["current"] == base, _C.allocator_stats()
    print("ok")
""")


def test_tensors_from_before_install_do_not_touch_the_count():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(zerort.__file__)))
    p = subprocess.run([sys.executable, "-c", BEFORE_INSTALL], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
