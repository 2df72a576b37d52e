"""``distbelief bench``: the paper's Figures 3-5 rerun on this machine, with the baselines a user would pick.

- :mod:`.fig3`: model-parallel step speedup vs partitions, fully connected vs locally connected.
- :mod:`.accuracy`: time-to-accuracy sweeps (Fig. 4: accuracy vs wall-clock time per method; Fig. 5: time to a
  fixed test accuracy vs cores), every distributed method starting from the same warmstart checkpoint. Their
  recipes are data (``recipes.toml``, read by :mod:`.recipes`); :mod:`.sweep` runs the methods, :mod:`.targets`
  computes times to target and checks the targets.
- :mod:`.throughput`: examples/s of Downpour against the single-machine baselines, with the defaults.

Each writes ``results.json`` (configs, measured series, machine) and PNG figures into ``--out``. Benchmarks are not
tests: the suite only checks their structure on tiny sizes.
"""
