"""deepspeed.utils.safe_set_full_fp32_param and safe_set_full_optimizer_state under torchrun
(ds_set_full_worker.py), at W = 2 and 4, stages 1-3, in RAM and on NVMe."""
import json
import os

import pytest

pytest.importorskip("transformers")

from zerort._testing.launch import launch  # noqa: E402

SET_FULL_CASES = {2: [{"name": "gpt2-s1", "model": "gpt2", "stage": 1, "tier": "none"},
                      {"name": "llama-s3-nvme", "model": "llama", "stage": 3, "tier": "nvme+params"}],
                  4: [{"name": "qwen2-s2-nvme", "model": "qwen2", "stage": 2, "tier": "nvme"},
                      {"name": "gpt2-s3", "model": "gpt2", "stage": 3, "tier": "none"}]}


@pytest.mark.parametrize("world", [2, 4])
def test_safe_set_full_takes_another_runs_state_bit_for_bit(tmp_path, world):
    """ds_set_full_worker.py: the masters and moments of one run set into a second engine read
    back the same bits and give the same held-out loss, at stages 1-3, in RAM and on NVMe."""
    (tmp_path / "nvme").mkdir()
    (tmp_path / "cases.json").write_text(json.dumps(SET_FULL_CASES[world]))
    launch("torchrun", world, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_set_full_worker.py"),
           tmp_path / "out", tmp_path / "nvme", tmp_path / "cases.json", timeout=600)
    result = json.loads((tmp_path / "out.json").read_text())
    for case in SET_FULL_CASES[world]:
        r = result[case["name"]]
        assert r["values_equal"] and r["loss_equal"] and r["loss_changed"], (case, r)
        assert r["files_left"] == [], (case, r)

