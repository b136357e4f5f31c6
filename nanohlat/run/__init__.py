"""Running a training job: everything around the step that is not the lesson.

Pre-flight, once before any worker starts (preflight.py), launching N
workers (launch.py), building this rank's model, runner and optimizer with
the step's tools (build.py), the token data and its cache (data.py),
everything around the step (session.py), what a run prints and writes
(trainlog.py), checkpoints (checkpoint/), a checkpoint's configuration and
this machine's memory checked before a command builds its model
(runconfig.py), one run per out-dir (runlock.py), stopping on a signal
(startup.py before training, at once; preempt.py once training, after the
step) and replica checks (replicas.py); failures at scale: the straggler
watch (stragglers.py), what a restart cost (restarts.py) and the fault lab's
faults on purpose (faults.py).

train.py calls into these. They stand on the core, system/ and tools/
(docs/design.md 1); serving/, the classroom and the commands stand on them,
and nothing below imports them.
"""
