"""flatshard's checkpoints on disk: one safetensors file per rank and a JSON manifest; atomic, verified,
pickle-free, and loadable at any world size, sharding factor or strategy.

    from flatshard import checkpoint
    checkpoint.save("ckpt/step_100", model, opt, step=100, extra={"lr": 3e-4})
    handle = checkpoint.save("ckpt/step_200", model, opt, step=200, async_save=True); handle.wait()
    step, extra = checkpoint.load("ckpt/step_200", model, opt)

save.py writes (its docstring has the layout and [Note: atomic commit]), load.py reads, format.py is
the bytes of a file ([Note: checksums]), tools.py is ``flatshard consolidate`` and ``flatshard inspect``.
"""

from flatshard.api import CheckpointError
from flatshard.checkpoint.format import shard_file
from flatshard.checkpoint.load import Loaded, load, read_manifest
from flatshard.checkpoint.save import AsyncSave, save

__all__ = ["save", "load", "AsyncSave", "Loaded", "CheckpointError", "read_manifest", "shard_file"]
