"""Config values and files the engine cannot honour are refused by key or path (issue 27):
FP32 values checked as FP32 holds them, bounded integers, integer literals of any length,
config files read with limits, and messages that list at most a few unknown keys.

Each test states what a user sees; test_config_fuzz.py throws random values at every key."""
import json
import math
import os

import pytest
import torch
import torch.nn as nn

import zerort
from zerort.config import MAX_FILE_BYTES, MAX_LISTED, parse
from zerort.errors import ConfigError

FP32_TINY = torch.finfo(torch.float32).tiny  # 1.1754944e-38, the smallest eps allowed
FP32_MAX_TEXT = "3.4028234e+38 (FP32's largest finite number)"
IN_FP32 = "in FP32, the dtype the engine computes with"


def problems(cfg, **kwargs):
    with pytest.raises(ConfigError) as e:
        parse(cfg, **kwargs)
    assert str(e.value).count("\n") == len(e.value.problems)
    return e.value.problems


# ---- FP32 values ----------------------------------------------------------------------------

def test_an_eps_that_is_0_in_fp32_is_refused_naming_the_smallest_allowed():
    for eps in (1e-46, 5e-324):
        assert problems({"optimizer": {"eps": eps}}) == [
            f"optimizer.eps: got {eps!r}, which is 0 {IN_FP32}; allowed: >= 1.1754944e-38 (FP32's smallest normal "
            "number), e.g. 1e-8"]
    assert problems({"zero_optimization": {}, "optimizer": {"type": "AdamW", "params": {"eps": 1e-40}}}) == [
        f"optimizer.params.eps: got 1e-40, which is subnormal {IN_FP32}; allowed: >= 1.1754944e-38 (FP32's smallest "
        "normal number), e.g. 1e-8"]
    assert parse({"optimizer": {"eps": 1.1754944e-38}}).optimizer.eps == 1.1754944e-38  # as the message prints it


def test_fp32_values_past_fp32s_range_or_below_its_normal_numbers():
    assert problems({"optimizer": {"lr": 1e39}}) == [f"optimizer.lr: got 1e+39; allowed: >= 0 and <= {FP32_MAX_TEXT}"]
    assert parse({"optimizer": {"lr": 3.4028234e38}}).optimizer.lr == 3.4028234e38  # the bound as printed
    assert problems({"optimizer": {"lr": 1e-46}}) == [
        f"optimizer.lr: got 1e-46, which is 0 {IN_FP32}; allowed: 0, or >= 1.1754944e-38 (FP32's smallest normal "
        "number)"]
    assert parse({"optimizer": {"lr": 0}}).optimizer.lr == 0  # 0 stays allowed where it was
    assert problems({"optimizer": {"betas": [1e-46, 0.9]}}) == [
        f"optimizer.betas: got [1e-46, 0.9], whose 1e-46 is 0 {IN_FP32}; allowed: each 0, or >= 1.1754944e-38 "
        "(FP32's smallest normal number)"]
    (line,) = problems({"fp16": {"enabled": True, "min_loss_scale": 1e-45}})
    assert line.startswith(f"fp16.min_loss_scale: got 1e-45, which is subnormal {IN_FP32}; allowed: >= 1.17"), line
    (line,) = problems({"gradient_clipping": 10 ** 400})  # an int past FP32, shown by its length
    assert line == f"gradient_clipping: got (an integer of 401 digits); allowed: >= 0 and <= {FP32_MAX_TEXT}"


def test_scheduler_numbers_are_fp32_values():
    lrs = {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 1e39]}}
    assert problems({"scheduler": lrs}) == [
        f"scheduler.params.warmup_max_lr: got [0.001, 1e+39], whose 1e+39 is inf {IN_FP32}; allowed: each <= "
        f"{FP32_MAX_TEXT}"]
    ratio = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 1e-300}}
    (line,) = problems({"scheduler": ratio})
    assert line.startswith(f"scheduler.params.cos_min_ratio: got 1e-300, which is 0 {IN_FP32}; allowed: 0, or "), line


# ---- bounded integers ---------------------------------------------------------------------

def test_prefetch_and_other_integers_are_bounded():
    # stage3.prefetch = 1e9 was accepted, and every unit hook then looped over the whole range.
    assert problems({"stage3": {"prefetch": 1_000_000_000}}) == [
        "stage3.prefetch: got 1000000000; allowed: >= 0 and <= 65536"]
    assert problems({"zero_optimization": {}, "zerort": {"stage3": {"prefetch": 65537}}}) == [
        "zerort.stage3.prefetch: got 65537; allowed: >= 0 and <= 65536"]
    assert parse({"stage3": {"prefetch": 65536}}).stage3.prefetch == 65536
    assert problems({"loss_scale": {"window": 2 ** 31}}) == [
        "loss_scale.window: got 2147483648; allowed: >= 1 and <= 2**31 - 1"]
    assert problems({"zero_optimization": {"stage3_prefetch_bucket_size": 1e15}}) == [
        "zero_optimization.stage3_prefetch_bucket_size: got 1000000000000000.0; allowed: >= 0 and <= 2**40"]
    never = parse({"steps_per_print": 1e12, "zero_optimization": {}})
    assert never.monitor.steps_per_print == 10 ** 12  # "never print"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_integer_literals_of_any_length_name_the_key(tmp_path):
    # A 5738-digit literal was a bare ValueError from json ("Exceeds the limit (4300 digits)").
    path = _write(tmp_path, "long.json", '{"stage": ' + "7" * 5738 + "}")
    assert problems(path) == ["stage: got 77777777777777777777...(an integer of 5738 digits); allowed: >= 0 and <= 3"]
    path = _write(tmp_path, "lr.json", '{"optimizer": {"lr": -' + "1" * 10_000 + '}, "bogus": ' + "2" * 5000 + "}")
    text = "\n".join(problems(path))
    assert "optimizer.lr: got -1111111111111111111...(an integer of 10000 digits); allowed: >= 0 and <= " in text
    assert "bogus: unknown or unsupported key (got 22222222222222222222...(an integer of 5000 digits))" in text
    (line,) = problems({"stage": 10 ** 5000})  # the same from a dict
    assert line == "stage: got (an integer of 5001 digits); allowed: >= 0 and <= 3"
    path = _write(tmp_path, "100.json", '{"gradient_accumulation_steps": ' + "1" * 100 + "}")  # an int still
    assert problems(path) == [f"gradient_accumulation_steps: got {'1' * 100}; allowed: >= 1 and <= 2**31 - 1"]


# ---- files read with limits ---------------------------------------------------------------

SPECIAL = "not a regular file; allowed: a regular file of at most 16 MiB (a config is a few KB): give the path of " \
          "the JSON file itself"


def test_a_link_to_dev_zero_a_directory_and_a_fifo_are_refused_unread(tmp_path):
    # A link to /dev/zero was read without limit (14.5 GB in 29 s).
    link = tmp_path / "ds_config.json"
    link.symlink_to("/dev/zero")
    assert problems(str(link)) == [f"config file {str(link)!r} (a link to '/dev/zero'): a character device, {SPECIAL}"]
    assert problems(str(tmp_path)) == [f"config file {str(tmp_path)!r}: a directory, {SPECIAL}"]
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: opening it for reading would block without O_NONBLOCK
    assert problems(str(fifo)) == [f"config file {str(fifo)!r}: a FIFO (named pipe), {SPECIAL}"]
    missing = tmp_path / "missing.json"
    assert problems(str(missing)) == [f"config file {str(missing)!r}: No such file or directory"]


def test_a_file_past_the_size_limit_is_refused(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing to write
    assert problems(str(big)) == [f"config file {str(big)!r}: {MAX_FILE_BYTES + 1} bytes, more than 16 MiB; allowed: "
                                  "a regular file of at most 16 MiB (a config is a few KB): is it the right file?"]
    at_limit = tmp_path / "at_limit.json"
    at_limit.write_bytes(b'{"stage": 1}' + b" " * (MAX_FILE_BYTES - 12))
    assert parse(str(at_limit)).stage == 1


def test_every_reader_of_a_config_path_has_the_limits(tmp_path):
    from zerort.integrations import deepspeed
    from zerort.integrations.deepspeed import launcher

    link = tmp_path / "ds_config.json"
    link.symlink_to("/dev/zero")
    want = f"config file {str(link)!r} (a link to '/dev/zero'): a character device, {SPECIAL}"
    with pytest.raises(ConfigError) as e:
        deepspeed.initialize(model=nn.Linear(2, 2), config=str(link))
    assert e.value.problems == [want]
    with pytest.raises(ConfigError) as e:
        launcher.read_hostfile(str(link))
    assert e.value.problems == [f"--hostfile {str(link)!r} (a link to '/dev/zero'): a character device, {SPECIAL}"]
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=" + "9" * 5000 + "\n")  # was a bare ValueError from int()
    with pytest.raises(ConfigError, match="line 1: .*each line is 'hostname slots=N'"):
        launcher.read_hostfile(str(hosts))


def test_the_hf_trainer_reads_its_config_path_with_the_limits(tmp_path):
    pytest.importorskip("accelerate")
    from zerort.integrations.hf import Trainer

    link = tmp_path / "ds_config.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as e:
        Trainer(model=nn.Linear(2, 2), zerort_config=str(link))  # refused before the Trainer is built
    assert e.value.problems == [f"config file {str(link)!r} (a link to '/dev/zero'): a character device, {SPECIAL}"]


# ---- messages list at most a few unknown keys ---------------------------------------------

def test_300000_unknown_keys_give_a_short_message_listing_the_known_keys_once(tmp_path):
    # It took 22 s and made a 105-million-character message: every line repeated the known keys.
    cfg = {f"key{i}": i for i in range(300_000)}
    for source in (cfg, _write(tmp_path, "many.json", json.dumps(cfg))):
        lines = problems(source)
        assert len(lines) == MAX_LISTED + 1 and len("\n".join(lines)) < 2000, lines
        assert lines[0].startswith("key0: unknown or unsupported key (got 0); known keys: stage, precision, optimizer")
        assert lines[1] == "key1: unknown or unsupported key (got 1)"  # the known keys once
        assert lines[-1] == "and 299990 more unknown keys (not listed)"


def test_unknown_keys_of_several_sections_each_list_their_sections_keys_once():
    lines = problems({"lrr": 1, "lr_": 2, "optimizer": {"epss": 1, "lrr": 2}})
    assert lines[0].startswith("optimizer.epss: unknown or unsupported key (got 1); did you mean 'optimizer.eps'?; "
                               "known keys in optimizer: lr, betas, eps"), lines
    assert lines[1] == "optimizer.lrr: unknown or unsupported key (got 2); did you mean 'optimizer.lr'?"
    assert lines[2].startswith("lr_: unknown or unsupported key (got 2); did you mean 'optimizer.lr'?; known keys: ")
    assert lines[3] == "lrr: unknown or unsupported key (got 1); did you mean 'optimizer.lr'?"


def test_keys_given_twice_and_auto_values_are_counted_past_a_limit(tmp_path):
    body = ", ".join(f'"k{i}": 1, "k{i}": 2' for i in range(1000))
    lines = problems(_write(tmp_path, "twice.json", "{" + body + "}"))
    twice = [ln for ln in lines if ln.startswith("k") and "given twice in one object" in ln]
    assert len(twice) == MAX_LISTED and "and 990 more keys given twice (not listed)" in lines
    lines = problems({"zero_optimization": {}, **{f"k{i}": "auto" for i in range(1000)}})
    assert len(lines) == 65 and lines[-1] == 'and 936 more "auto" values (not listed)'


# ---- an accepted extreme config trains ----------------------------------------------------

class HalfUsed(nn.Module):
    """A linear layer whose first input is always 0: those weights get gradient 0, where
    an eps that FP32 makes 0 turned the update into 0 / 0 = NaN."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("stage,precision", [(0, "bf16"), (2, "fp16"), (3, "fp32")])
def test_the_smallest_allowed_values_train_with_finite_masters(stage, precision):
    cfg = {"stage": stage, "precision": precision, "comm": {"backend": "inprocess"},
           "optimizer": {"lr": 1e-3, "eps": 1.1754944e-38, "betas": [FP32_TINY, 0.999], "weight_decay": FP32_TINY},
           "gradient_clipping": 3.4028234e38, "loss_scale": {"min_scale": FP32_TINY}, "stage3": {"prefetch": 65536}}
    e = zerort.initialize(HalfUsed(), cfg)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 4, generator=g)
        x[:, 0] = 0
        e.backward(nn.functional.mse_loss(e(x).float(), torch.randn(4, 2, generator=g)))
        e.step()
    masters = e.full_state_dict(master=True)
    assert e.skipped_steps == 0 and e.global_steps == 3
    assert all(torch.isfinite(t).all() for t in masters.values()), masters
    assert not torch.equal(masters["a.weight"][:, 1:], HalfUsed().a.weight[:, 1:])  # it trained
    assert math.isfinite(float(masters["a.weight"][:, 0].abs().max()))
