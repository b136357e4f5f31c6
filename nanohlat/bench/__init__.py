"""`python -m nanohlat.bench`: the speed benchmark (bench.py), one training
step of train.py's (run/build.py) beside Hugging Face's Llama, and generation
(serving/). It sits on the top floor with the other commands: it uses every
floor below it, and nothing imports it."""
