"""The recipe as every command takes it: what a run is made of, whether it can work, and train.py's flags.

    configs.py       config.py's dataclasses with the fields of beyond/'s extensions, each value's
                     check (`validate`), the presets of both
    layouts.py       whether a layout can split the model and the batch (`check_layout`), one line
                     naming what to choose when it cannot
    command_line.py  train.py's flags: one per field, `--preset` the start (`parse_args`)

It stands on the core, its extensions (their fields' allowed values) and system/ (the one-line
refusal); every floor above reads its recipe from here. The names below are what the rest of
nanohlat and the tests use (`from nanohlat import recipe; recipe.parse_args(...)`).
"""

from nanohlat.recipe.command_line import HELP, build_parser, parse_args, resolve
from nanohlat.recipe.configs import (HIGHEST, MAX_SIZE, MOST, MTBF_HOURS_PER_NODE, PRESETS, SAVE_EVERY_AUTO, SEED_LIMIT,
                                     THREADS_LIMIT, ModelConfig, TrainConfig, check_counts,
                                     check_seed, model_from_dict, to_dict)
from nanohlat.recipe.layouts import check_cp_layout, check_layout, check_moe_layout, choices, divisors
