"""Several machines on one: an emulated cluster of network namespaces joined by slow links (root, ``ip``
and ``tc``), the training jobs run on it, and the planner's predictions of them (docs/multi_node.md).

__main__.py    python -m bench.cluster run | measure | clean (make cluster's first part)
net.py         the namespaces, the links and a torchrun job across them ([Note: the emulated cluster])
jobs.py        one job of the worker at a rate, where results go, the commit measured
worker.py      what runs in every rank of a measurement (torchrun ... -m bench.cluster.worker)
calibrate.py   the links and collectives measured in the ranks before the systems
predict.py     the planner's step times from a calibration; python -m bench.cluster.predict (no root)
hsdp.py        PyTorch FSDP2's HSDP as a user runs it (make cluster's second part)
slow_link.py   flatshard's settings for traffic between nodes, off and on, interleaved
smoke.py       the small job of tests/test_cluster.py
"""
