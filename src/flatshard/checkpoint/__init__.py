"""flatshard's checkpoints on disk: one safetensors file per rank and a JSON manifest; crash-safe,
verified, pickle-free, and loadable at any world size, sharding factor or strategy.

    from flatshard import checkpoint
    checkpoint.save(checkpoint.step_path("ckpt", 100), model, opt, step=100, extra={"lr": 3e-4}, keep_last=3)
    handle = checkpoint.save(checkpoint.step_path("ckpt", 200), model, opt, step=200, async_save=True)
    handle.wait()
    step, extra = checkpoint.load(checkpoint.latest("ckpt"), model, opt)

    ckpt = checkpoint.Checkpointer("ckpt", model, opt, every=100, keep_last=3)   # a loop that resumes itself
    start = ckpt.resume()
    for step in range(start, steps): ...; ckpt.step_done(step + 1, final=step + 1 == steps)

save.py writes (its docstring has the layout), directory.py decides which directories are complete
checkpoints ([Note: crash-safe commit], [Note: latest and rotation]), load.py reads, format.py is the
bytes of a file ([Note: checksums]), export.py writes what a plain model or Hugging Face loads, and
tools.py is ``flatshard consolidate`` and ``flatshard inspect``; resume.py is the ``Checkpointer`` a
loop resumes with (its docstring: "The loop's own state"). A fully_shard model (DTensor parameters) is
saved in DCP's safetensors format instead (dtensors.py, [Note: fully_shard checkpoints are DCP
safetensors]); front.py's ``save`` and ``load`` choose by the model.
"""

from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import latest, read_manifest, step_path
from flatshard.checkpoint.format import shard_file
from flatshard.checkpoint.front import load, save
from flatshard.checkpoint.load import Loaded
from flatshard.checkpoint.resume import Checkpointer
from flatshard.checkpoint.save import AsyncSave

__all__ = [
    "save",
    "load",
    "latest",
    "step_path",
    "AsyncSave",
    "Checkpointer",
    "Loaded",
    "CheckpointError",
    "read_manifest",
    "shard_file",
]
