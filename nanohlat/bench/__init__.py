"""`python -m nanohlat.bench`: the speed benchmark. The code is nanohlat/tools/bench.py; this
package only keeps the command's short name."""
