"""`python -m nanohlat.hf`: Hugging Face export and import. The code is nanohlat/serving/hf.py; this
package only keeps the command's short name."""
