"""Running a training job: everything around the step that is not the lesson.

Pre-flight, once before any worker starts (preflight.py), and launching N
workers (launch.py), building this rank's model, runner and optimizer
(build.py), the token data and its cache (data.py), everything around the
step (session.py): checkpoint files and the run directory's safety
(checkpoint/, files.py, runlock.py), a checkpoint's configuration checked
before a command builds its model (runconfig.py), stopping on a signal (preempt.py),
replica checks (replicas.py), what a run prints and writes (metrics.py), and the
flag parser every command line uses (flags.py: one-line errors). train.py calls into these;
the core modules one folder up never import them.
"""
