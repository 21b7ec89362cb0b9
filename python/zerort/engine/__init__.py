"""The engine: zerort.initialize and the Engine it returns (engine), engine.optimizer's
param groups (optimizer), DeepSpeed's schedules (lr_schedules), stage 3's module hooks
(stage3), meta-device models (meta_init), the non-finite guard (nonfinite), the one-model
check (same_model), and ending a job when one rank fails (failfast)."""
from zerort.engine.engine import Engine, initialize  # noqa: F401
