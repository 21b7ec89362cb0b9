"""Other frameworks' entry points on zerort: DeepSpeed's (deepspeed: initialize, zero.Init,
its config schema in zerort.config) and HuggingFace's Trainer (hf)."""
