"""The run orchestrator: ``eagle3nb run params/<run>/`` executes the stage notebooks in order with papermill,
skips what is done, re-runs what failed or was killed (each stage resumes from its own files), and can
detach into its own session; ``eagle3nb status outputs/<run>/`` reads what it recorded.

``outputs/<run>/`` holds, besides each stage's own folder: ``NN_name.ipynb`` (executed notebook),
``NN_name.html`` (report without input cells), ``run.log`` (timestamped runner lines and every cell's
output), ``status.json`` (per-stage state, times, paths, errors), ``run.lock`` (held while a run is alive)
and ``run.pid``. Papermill and nbconvert are imported only when a stage runs, so ``status`` is instant.

The package by what it does: ``plan`` (parameters and notebooks validated before work), ``lock`` (one live run
per folder), ``execute`` (papermill, run.log, signals, detach), ``status`` (status.json against reality),
``cli`` (``eagle3nb run`` and ``eagle3nb status``).
"""

STATUS_FILE = "status.json"
LOG_FILE = "run.log"
LOCK_FILE = "run.lock"
PID_FILE = "run.pid"
