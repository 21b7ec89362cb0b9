"""Where the memory and the time go: model-state bytes per stage (memory), the allocator's
figures per phase of a step (phases), and the planner of runs larger than this machine
(planner)."""
