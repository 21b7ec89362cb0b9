"""The examples run briefly: train_gpt.py without a launcher (world size 1), train_deepspeed.py
under torchrun."""
import os
import sys

from zerort._testing.launch import launch, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_gpt_launcher_free_smoke():
    p = launch("alone", 1, os.path.join(ROOT, "examples", "train_gpt.py"), "--launcher-free", "--steps", 3,
               "--layers", 2, "--d-model", 64, "--seq", 32, "--precision", "fp16", timeout=300)
    assert "W=1 [inprocess]" in p.stdout and "step   3  loss" in p.stdout, p.stdout


def test_train_deepspeed_under_torchrun(tmp_path):
    """The DeepSpeed script with its config, as docs/DEEPSPEED.md runs it, for 10 updates."""
    p = launch("torchrun", 2, os.path.join(ROOT, "examples", "train_deepspeed.py"), "--deepspeed_config",
               os.path.join(ROOT, "examples", "ds_config.json"), "--steps", 10, "--save-dir", tmp_path, timeout=300)
    assert "[Rank 0] step=10, skipped=0, lr=[0.0014666666666666667, 0.0014666666666666667]" in p.stdout, p.stdout
    assert f"saved and loaded {tmp_path}/step10: client_state {{'updates': 10}}, 160 samples" in p.stdout, p.stdout



def test_train_hf_trainer_under_accelerate_launch_then_resumed_under_torchrun(tmp_path):
    """The Trainer script as docs/HF.md runs it: 10 steps under `accelerate launch`, then
    resumed from its checkpoint-10 to 20 under torchrun; the monitor's CSV holds steps 1-20."""
    script, out = os.path.join(ROOT, "examples", "train_hf_trainer.py"), str(tmp_path / "hf")
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    p = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
             "no", "--dynamo_backend", "no", script, "--steps", "10", "--output-dir", out], timeout=300)
    assert f"from_pretrained {out}/final: torch.float32, 656512 parameters" in p.stdout, p.output
    assert os.path.isfile(os.path.join(out, "checkpoint-10", "latest")), os.listdir(out)
    p = launch("torchrun", 2, script, "--steps", 20, "--output-dir", out, "--resume", timeout=300)
    assert "'epoch': '0.07812'" in p.stdout and "eval_loss" in p.stdout, p.output
    with open(os.path.join(out, "runs", "llama", "metrics.csv")) as f:
        assert [int(r.split(",")[0]) for r in f if r[0].isdigit()] == list(range(1, 21))
