"""State dicts in memory, as PyTorch FSDP names them: the model's (module.py: FULL, LOCAL, SHARDED),
the optimizer's (optim.py), their settings (settings.py), SHARDED values for
torch.distributed.checkpoint (sharded_tensors.py), all read through one view of the model
(model_view.py). Imports the engine (runtime/), never a front end or the checkpoint package.
"""
