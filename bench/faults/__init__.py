"""Failures on purpose: ranks killed and stopped, and what the run does after.

replica_faults.py          replica groups on torchft that drop out and rejoin, on the emulated cluster
                           or on loopback: python -m bench.faults.replica_faults [--local]
replica_faults_worker.py   one rank of one replica group (torchrun ... -m bench.faults.replica_faults_worker)
soak.py                    examples/train_gpt.py restarted through many injected faults, checked bitwise
                           against a run without (make soak: python -m bench.faults.soak)
"""
