"""deepspeed.utils.zero_to_fp32 on zerort's checkpoints (zerort.state.consolidate does the work).

    sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")          # {name: FP32 tensor}, in memory
    convert_zero_checkpoint_to_fp32_state_dict("ckpt", "out_dir")  # out_dir/pytorch_model.bin
    model = load_state_dict_from_zero_checkpoint(model, "ckpt")

checkpoint_dir is what engine.save_checkpoint(save_dir) was given (its `latest` names the
tag), as in DeepSpeed. No process group is needed.
"""
import os

import torch

from zerort.integrations.deepspeed.names import not_provided
from zerort.state import consolidate as _consolidate

FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    sd = _consolidate.state_dict(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        from zerort.state.metadata import read_meta

        trained = set(read_meta(checkpoint_dir, tag)[1]["params"])
        sd = {k: v for k, v in sd.items() if k in trained}
    return sd


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Writes the FP32 state_dict to output_dir/pytorch_model.bin (model.safetensors with
    safe_serialization), in one file whatever max_shard_size says. An output_dir that ends
    in .bin, .pt, .pth or .safetensors is taken as the file itself (DeepSpeed's older
    output_file argument). Returns the path written."""
    out = output_dir if str(output_dir).endswith(FILE_SUFFIXES) else os.path.join(
        output_dir, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if exclude_frozen_parameters:
        sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters=True)
        torch.save(sd, out)
        return out
    return _consolidate.consolidate(checkpoint_dir, out, tag, safetensors=str(out).endswith(".safetensors"))


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Loads the checkpoint's FP32 values into model (on CPU) and returns it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model


__getattr__ = not_provided(__name__)
