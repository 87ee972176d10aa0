"""The single controller: resource pools (placement.py), worker groups (worker_group.py),
dispatch modes (dispatch.py), the worker base class (worker.py) and Ray start-up (cluster.py).

Import from the submodules; this package imports nothing eagerly so that cluster.py can
prepare Ray's environment before Ray is imported.
"""
