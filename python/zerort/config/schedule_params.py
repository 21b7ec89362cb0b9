"""The params of each of DeepSpeed's schedules (zerort.engine.lr_schedules), as the
config's scheduler section takes them: the parser checks them, the schedules take them."""

# Each schedule's config params: name -> (kind, required). kind: "number", "numbers" (a
# number or one per param group), "int", "bool", "warmup_type".
PARAMS = {
    "WarmupLR": {"warmup_min_lr": ("numbers", False), "warmup_max_lr": ("numbers", False),
                 "warmup_num_steps": ("int", False), "warmup_type": ("warmup_type", False),
                 "last_batch_iteration": ("int", False)},
    "WarmupCosineLR": {"total_num_steps": ("int", True), "warmup_min_ratio": ("number", False),
                       "warmup_num_steps": ("int", False), "cos_min_ratio": ("number", False),
                       "warmup_type": ("warmup_type", False), "last_batch_iteration": ("int", False)},
    "LRRangeTest": {"lr_range_test_min_lr": ("numbers", False), "lr_range_test_step_size": ("int", False),
                    "lr_range_test_step_rate": ("number", False), "lr_range_test_staircase": ("bool", False),
                    "last_batch_iteration": ("int", False)},
    "OneCycle": {"cycle_min_lr": ("numbers", True), "cycle_max_lr": ("numbers", True),
                 "decay_lr_rate": ("number", False), "cycle_first_step_size": ("int", False),
                 "cycle_second_step_size": ("int", False), "cycle_first_stair_count": ("int", False),
                 "cycle_second_stair_count": ("int", False), "decay_step_size": ("int", False),
                 "cycle_momentum": ("bool", False), "cycle_min_mom": ("numbers", False),
                 "cycle_max_mom": ("numbers", False), "decay_mom_rate": ("number", False),
                 "last_batch_iteration": ("int", False)},
}
PARAMS["WarmupDecayLR"] = {**PARAMS["WarmupLR"], "total_num_steps": ("int", True)}
