"""How a model is laid out for ZeRO, before any step runs: which modules compute in FP32
and the parameter groups (precision), stage 3's units and which parameters each holds
(units), and which rank holds which elements of every parameter (shard_map). The engine,
the memory accounting and the checkpoints all read the layout from here."""
