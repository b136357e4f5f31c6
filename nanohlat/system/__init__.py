"""What every nanohlat program shares with the operating system, on the floor
just above the core so that every floor above can use it (docs/design.md 1).

files.py: every file a run, an eval, an export or the classroom kit writes is
written whole or not at all, never through a link at its name (atomic_write,
write_text, open_append), file hashes, and an OSError said in one line
(os_error_message).
cli.py: how every command ends, written once (`command`, around each main):
bad input, an OSError, Ctrl-C or an exercise stub of a student copy reached
(`not_done`) as one line and an exit code, a crash with its traceback.
flags.py: the flag parser of every command line (`Parser`): a flag it cannot
read is one line and exit code 2, not a page of usage.
"""
