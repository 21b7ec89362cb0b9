"""What training leaves on disk: sharded checkpoints (checkpoint; their files, files; their
metadata, metadata; the loop's state beside them, loop_state), laid out by
zerort.layout.shard_map, and offline consolidation (consolidate)."""
from zerort.state import checkpoint  # noqa: F401  (zerort.state.checkpoint.save / load)
