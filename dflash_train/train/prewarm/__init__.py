"""The compile prewarm (train.compile_prewarm): the training step compiled in a separate process while the run
loads its target and builds its data. `launch.py` is the run's side (start, wait, say), `worker.py` the process."""
