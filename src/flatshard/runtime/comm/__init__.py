"""Bytes between ranks: knows tensors, process groups and streams, never units (tests/test_layering.py
holds that nothing here imports the engine above it).

  comm/collectives.py    every collective of the package, each returning a CollectiveResult
  comm/gloo_exchange.py  point-to-point exchanges on gloo (tagged, int8 across nodes)
  comm/mesh.py           process groups and device meshes: the shard and replicate groups
  comm/streams.py        the gather, reduce and compute streams, and a recording stand-in
  comm/agree.py          every rank ends alike: agreed errors and small gathers of JSON
  nodes.py          which ranks share a node, which peers a group has on others
  int8.py           the block-wise int8 codec of what crosses nodes
"""
