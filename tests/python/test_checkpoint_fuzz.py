"""Corrupted checkpoints (tests/fuzz/fuzz_checkpoint_meta.py): every damaged meta.json,
`latest` or shard file of the corpus is rejected by both loaders (engine.load_checkpoint
and zerort.state.consolidate) with a CheckpointError naming the file and the field, never
another exception and never a silent load; edits that change nothing a loader uses load
the same values; and seeded random byte mutations raise nothing but CheckpointError."""
import os
import subprocess
import sys

import pytest
import torch

import zerort
from zerort._testing.launch import launch
from zerort.state.checkpoint import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fuzz"))
import fuzz_checkpoint_meta as fz  # noqa: E402
from engine_models import CONFIG, make_model  # noqa: E402

pytestmark = pytest.mark.skipif(not zerort._C.with_mpi, reason="the seed checkpoint is saved by 2 ranks under mpirun")


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("seed")
    launch("mpirun", 2, os.path.join(HERE, "ckpt_worker.py"), "train", d, "transformer", 3, 1, timeout=120)
    return str(d / "ckpt")


def engine():
    return zerort.initialize(make_model("transformer"), dict(CONFIG, stage=2, precision="fp16"),
                             comm=zerort.comm.init("inprocess"))


@pytest.fixture(scope="module")
def reference(seed):
    e = engine()
    e.load_checkpoint(seed)
    return e.full_state_dict(master=True)


def test_corpus_is_rejected_naming_file_and_field(seed, tmp_path):
    cases = fz.corpus(seed)
    assert len(cases) > 100
    work, e = str(tmp_path / "ckpt"), engine()
    failures = []
    for name, apply, expect in cases:
        for loader in ("engine.load_checkpoint", "consolidate"):
            fz.fresh_copy(seed, work)
            apply(work)
            try:
                e.load_checkpoint(work) if loader == "engine.load_checkpoint" else fz.exercise(work)
            except CheckpointError as err:
                missing = [s for s in expect if s not in str(err)]
                if missing:
                    failures.append(f"{name} [{loader}]: message lacks {missing}: {err}")
            except Exception as err:  # noqa: BLE001 - the point: nothing but CheckpointError
                failures.append(f"{name} [{loader}]: {type(err).__name__}: {err}")
            else:
                failures.append(f"{name} [{loader}]: loaded without an error")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name,apply", fz.NEUTRAL, ids=[n for n, _ in fz.NEUTRAL])
def test_harmless_edits_load_the_same_values(seed, reference, tmp_path, name, apply):
    work = fz.fresh_copy(seed, str(tmp_path / "ckpt"))
    apply(work)
    e = engine()
    e.load_checkpoint(work)
    got = e.full_state_dict(master=True)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    fz.exercise(work)


def test_random_mutations_raise_only_checkpoint_errors(seed):
    loaded, rejected = fz.run_random(seed, iterations=300, rng_seed=1234)
    assert loaded + rejected == 300 and rejected > 250, (loaded, rejected)


def test_fuzz_entry_point_runs_standalone(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(HERE, "..", "fuzz", "fuzz_checkpoint_meta.py"),
                        "--iterations", "20"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "20 mutated meta.json files" in p.stdout and "no other exception" in p.stdout
