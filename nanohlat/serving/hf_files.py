"""The files of a Hugging Face model folder, for serving/hf.py's export and import:
reading config.json and the weights' shards, and the folders export writes
through (its `HF_DIR.partial`, moved into place whole or file by file).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import torch

from nanohlat.config import UserError
from nanohlat.system import files


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("reading or writing .safetensors needs the safetensors package: "
                        "pip install safetensors") from None
    return safetensors.torch


def read_hf_dir(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, merged state of all *.safetensors or pytorch_model*.bin shards)."""
    return read_hf_config(hf_dir), read_hf_weights(hf_dir)


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Hugging Face model directory, as a dict."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{hf_dir!r} has no config.json; give a Hugging Face model directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (ValueError, RecursionError) as e:   # (UnicodeDecodeError is a ValueError)
        raise UserError(f"{config_path} is not valid JSON ({e.__class__.__name__}); the model directory "
                        f"is damaged") from None
    if not isinstance(hf_config, dict):
        raise UserError(f"{config_path} is not a JSON object; the model directory is damaged")
    return hf_config


def read_hf_weights(hf_dir: str, origin: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The merged state of all *.safetensors or pytorch_model*.bin shards of a model directory
    (`origin`, if given, gets the file of each tensor)."""
    state = {}
    shards = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    st = _safetensors() if shards else None
    if not shards:
        shards = sorted(glob.glob(os.path.join(hf_dir, "pytorch_model*.bin")))
    for path in shards:
        try:
            part = st.load_file(path) if st else torch.load(path, map_location="cpu", weights_only=True)  # no code
        except Exception as e:  # noqa: BLE001 - any failure to parse the file means it is damaged
            raise UserError(f"{path} cannot be read ({e.__class__.__name__}); the file is truncated or "
                            f"damaged") from None
        state.update(part)
        if origin is not None:
            origin.update(dict.fromkeys(part, path))
    if not shards:
        raise UserError(f"{hf_dir!r} has no *.safetensors or pytorch_model*.bin weights")
    return state


def _refuse_non_empty(path: str, what: str, overwrite: bool = False) -> None:
    """A target folder: refused if it is no folder (a file, a FIFO, a device: even with --overwrite,
    which replaces files inside a folder), or holds something unless --overwrite."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{what} {path!r} is {files.not_a_file(os.path.realpath(path)) or 'a file'}, not a folder; "
                        f"choose a new folder{' (--overwrite replaces the files inside one)' if overwrite else ''}")
    if not overwrite and os.path.exists(path) and os.listdir(path):
        raise UserError(f"{what} {path!r} is not empty; choose a new folder, or pass --overwrite to replace "
                        f"what it holds")


EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json")


def _partial_dir(hf_dir: str) -> str:
    """`HF_DIR.partial`, the export's temporary folder, made anew. One left by a killed
    export (nothing but export files in it) is removed; anything else there is refused."""
    tmp = os.path.normpath(os.path.abspath(hf_dir)) + ".partial"
    if files.not_a_file(tmp) not in (None, "a folder"):
        raise UserError(f"{tmp!r} is {files.not_a_file(tmp)}, where export writes first; move it away or choose "
                        f"another HF_DIR")
    if os.path.islink(tmp) or os.path.isfile(tmp):
        os.unlink(tmp)                 # (nanohlat makes no link or file there)
    elif os.path.isdir(tmp):
        if not all(n.removesuffix(".partial") in EXPORT_FILES for n in os.listdir(tmp)):
            raise UserError(f"{tmp!r} holds other files, and export writes there first; move it away or "
                            f"choose another HF_DIR")
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def _move_into(tmp: str, hf_dir: str) -> None:
    """The complete export in `tmp` becomes HF_DIR: renamed as a whole when HF_DIR
    does not exist (or is an empty folder), else file by file (--overwrite: other
    files in HF_DIR stay; a link at one of our names is replaced, never followed)."""
    if os.path.isdir(hf_dir) and not os.path.islink(hf_dir) and not os.listdir(hf_dir):
        os.rmdir(hf_dir)
    if not os.path.lexists(hf_dir):
        os.replace(tmp, hf_dir)
    else:
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(hf_dir, name))
    files.fsync_dir(os.path.dirname(os.path.abspath(hf_dir)))
