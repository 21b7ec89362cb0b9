"""zerort.integrations.hf.config: "auto" filled from TrainingArguments as HuggingFace fills it for
DeepSpeed (transformers' HfTrainerDeepSpeedConfig: fill when "auto", else must match), in
both config forms; and zerort.integrations.hf.Trainer's refusals, each naming what to change."""
import os
import sys

import pytest

pytest.importorskip("accelerate")
import transformers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from engine_models import hf_model  # noqa: E402

import zerort.integrations.hf  # noqa: E402
from zerort.config import parse  # noqa: E402
from zerort.errors import ConfigError  # noqa: E402
from zerort.integrations.hf.config import fill, scheduler_spec  # noqa: E402


def args(tmp_path, **kw):
    values = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=3, gradient_accumulation_steps=2,
                  learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.05,
                  max_grad_norm=0.7, warmup_steps=0.25, report_to=[])
    return transformers.TrainingArguments(**{**values, **kw})


def test_deepspeed_form_autos_take_the_arguments_and_the_hidden_size(tmp_path):
    raw = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    cfg, ds = fill(raw, args(tmp_path, bf16=True), hf_model("llama"))  # hidden size 32
    assert ds and raw["gradient_clipping"] == "auto"  # the caller's dict is not changed
    z = cfg["zero_optimization"]
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == \
        (3, 2, 6)
    assert cfg["gradient_clipping"] == 0.7 and cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05}
    assert (z["stage"], z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"],
            z["stage3_param_persistence_threshold"]) == (2, 1024, 921, 320)
    assert cfg["scheduler"]["params"]["warmup_min_lr"] == 0 and cfg["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    spec = scheduler_spec(cfg["scheduler"], args(tmp_path), 40)
    assert spec["params"]["total_num_steps"] == 40 and spec["params"]["warmup_num_steps"] == 10  # 0.25 of 40
    c = parse({k: v for k, v in cfg.items() if k != "scheduler"}, form="deepspeed")
    assert (c.stage, c.precision, c.optimizer.lr, c.reduce_bucket_numel) == (2, "bf16", 3e-4, 1024)


def test_our_form_autos_and_absent_keys_follow_the_arguments(tmp_path):
    cfg, ds = fill({"stage": 3, "optimizer": {"lr": "auto"}, "reduce_bucket_numel": "auto"}, args(tmp_path),
                   hf_model("gpt2"))
    assert not ds
    assert cfg["precision"] == "fp32"  # no --bf16/--fp16: not zerort's bf16 default
    assert cfg["optimizer"] == {"lr": 3e-4} and cfg["reduce_bucket_numel"] == 32 * 32
    assert (cfg["gradient_clipping"], cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]) == \
        (0.7, 2, 3)
    assert parse(cfg).stage == 3


def test_every_value_that_disagrees_is_listed(tmp_path):
    raw = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4, "fp16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError) as e:
        fill(raw, args(tmp_path), hf_model("gpt2"))
    text = str(e.value)
    for what in ("gradient_accumulation_steps: 4", "gradient_accumulation_steps gives 2", "fp16.enabled: True",
                 "optimizer.params.lr: 0.001", "learning_rate gives 0.0003"):
        assert what in text, text


def test_hidden_size_autos_need_a_hidden_size(tmp_path):
    import torch

    with pytest.raises(ValueError, match="hidden_size"):
        fill({"reduce_bucket_numel": "auto"}, args(tmp_path), torch.nn.Linear(2, 2))


@pytest.mark.parametrize("change, named", [
    (dict(optim="sgd"), "optim='sgd'"),
    (dict(torch_compile=True), "torch_compile"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    (dict(bf16_full_eval=True), "bf16_full_eval"),
    (dict(save_only_model=True), "save_only_model"),
])
def test_the_trainer_refuses_what_zerort_does_not_run(tmp_path, change, named):
    with pytest.raises(ValueError, match="zerort.integrations.hf.Trainer cannot run with") as e:
        zerort.integrations.hf.Trainer(model=hf_model("gpt2"), args=args(tmp_path, **change),
                                       zerort_config={"stage": 1})
    assert named in str(e.value)


def test_a_config_that_is_not_a_dict_or_path_is_refused(tmp_path):
    with pytest.raises(zerort.ConfigError, match="zerort_config is a list"):
        zerort.integrations.hf.Trainer(model=hf_model("gpt2"), args=args(tmp_path), zerort_config=[1])


def test_a_config_file_is_read_with_its_checks(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"stage": 3, "stage": 1}')
    with pytest.raises(ConfigError, match="stage: given twice in one object of config file"):
        zerort.integrations.hf.Trainer(model=hf_model("gpt2"), args=args(tmp_path), zerort_config=str(path))
    with pytest.raises(ConfigError, match="missing.json"):
        zerort.integrations.hf.Trainer(model=hf_model("gpt2"), args=args(tmp_path),
                                       zerort_config=str(tmp_path / "missing.json"))


def test_a_checkpoint_without_zerort_state_is_named_with_its_cause(tmp_path):
    (tmp_path / "trainer_state.json").write_text("{}")
    text = zerort.integrations.hf._no_zerort_state(str(tmp_path))
    assert "a stock Trainer (or save_only_model) wrote it" in text and "zerort.integrations.hf.from_pretrained" in text


@pytest.mark.parametrize("config,named", [
    ({"stage": 1, "optimizer": {"lr": 1e-3}}, "optimizer.lr"),  # disagrees with learning_rate=3e-4
    ({"stage": 1, "gradient_clipings": 1.0}, "gradient_clipings"),  # a misspelt key
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False, "bogus": 1}}, "bf16.bogus"),
])
def test_a_bad_zerort_config_is_an_error_when_the_trainer_is_built(tmp_path, config, named):
    """Before any dataset is tokenized or model wrapped: at Trainer(...), not inside train()."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        zerort.integrations.hf.Trainer(model=hf_model("gpt2"), args=args(tmp_path), zerort_config=config)
