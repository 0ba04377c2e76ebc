"""shardlab: train models that no longer fit, from Hydra configs, on PyTorch's FSDP2.

The built-in task plug-ins are the package ``shardlab_tasks`` beside this one (a name of shardlab's own, so no user's
``tasks/`` shadows them and no other distribution owns it); the configs are package data in ``shardlab/conf``.
"""
