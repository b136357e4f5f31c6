"""`python -m nanohlat.harness`: the lm-evaluation-harness adapter. The code is nanohlat/serving/harness.py; this
package only keeps the command's short name."""
