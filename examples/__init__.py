"""flatshard's examples are scripts: each runs as ``python examples/<name>.py`` (or under torchrun).

They import one another by file name (``from gpt import GPT``), as a copy of a script beside the files
it names does in a folder of its own; a package-relative import would fail in a script run as a file.
This file makes the ones that import no sibling (gpt.py, local_launch.py, fault_injection.py,
owned_optim.py) importable from the repository root as ``examples.<name>`` as well: bench/ builds the
example GPT and starts its ranks with them. A script that imports its siblings (train_gpt.py,
big_model.py) is run as a file, never imported that way.
"""
