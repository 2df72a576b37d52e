"""The baselines a user would otherwise pick on one machine, without a parameter server, one module per job:

- :mod:`.loop`: the loop shell of the one-replica runs (training clock, evaluation cadence, stop conditions,
  summary), shared by single-process SGD and the partitioned replica (``partition/baseline.py``).
- :mod:`.single`: single-process SGD with ``torch.optim`` (``run_single_process``, ``make_torch_optimizer``).
- :mod:`.progress`: the shared-memory progress block between the multiprocess driver and its workers.
- :mod:`.workers`: what runs in a hogwild or ddp worker process (importable at module level: workers start
  with forkserver or spawn).
- :mod:`.processes`: process plumbing (start method, picklability, ports, exit texts).
- :mod:`.multiprocess`: the hogwild / ddp driver (``run_hogwild``, ``run_ddp``).

Nothing is imported here, so a worker process that unpickles one of these modules loads only what it needs.
"""
