"""The config cache: the fastest normal-mode Config per machine, rank count and call kind, as `moe-ep-bench
tune` measured them, read by Buffer.get_dispatch_config / get_combine_config (and by the calls made
without config=, which use the same configs).

The file is JSON: {"version": 1, "entries": {KEY: ENTRY}}, KEY naming the GPU (torch.cuda.get_device_name,
"cpu" where torch sees no GPU), the number of ranks, the ranks per GPU (the ranks over the GPUs this
process sees, rounded up, as the RankPool and the MPS share count them) and the kind ("dispatch" or
"combine"). ENTRY holds "config" (the fastest Config's fields, SM budget included) and "by_sms" (the
fastest chunk sizes at each SM budget tried), with what was measured and how, for the reader.

Where it is: $MOE_EP_CONFIG_CACHE if set (an empty value: no cache), else
$XDG_CACHE_HOME/moe_ep/configs.json, else ~/.cache/moe_ep/configs.json. A process reads it once, on the
first get_*_config (or default-config call); without a file, or without an entry for the machine, the
configs are the built-in defaults (moe_ep.config). A file that cannot be read as a cache gives one
warning and the defaults.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Optional

from .config import Config

CACHE_ENV = "MOE_EP_CONFIG_CACHE"
VERSION = 1
KINDS = ("dispatch", "combine")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(Config))

# path -> its entries, read once per process (a path that was written here is read again).
_read: Dict[Path, dict] = {}
# device index -> (name, count): the GPU's name and the GPUs visible, asked once.
_devices: Dict[int, tuple] = {}


def cache_path() -> Optional[Path]:
    """The cache file this process reads and `moe-ep-bench tune` writes by default (None: no cache)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value).expanduser() if value else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe_ep" / "configs.json"


def entry_key(device: str, num_ranks: int, ranks_per_gpu: int, kind: str) -> str:
    return f"{device} | {num_ranks} ranks | {ranks_per_gpu} per GPU | {kind}"


def this_machine(num_ranks: int) -> tuple:
    """(device name, ranks per GPU) that key this process's entries for num_ranks ranks."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", num_ranks
    index = torch.cuda.current_device()
    if index not in _devices:
        _devices[index] = (torch.cuda.get_device_name(index), torch.cuda.device_count())
    name, count = _devices[index]
    return name, -(-num_ranks // count)


def config_of(fields: dict) -> Config:
    """A Config from an entry's field dict (ValueError/TypeError/KeyError where it is not one)."""
    return Config(*(int(fields[name]) for name in CONFIG_FIELDS))


def _check_entry(entry) -> None:
    """Raises where an entry would not give valid Configs."""
    config_of(entry["config"])
    for num_sms, fields in entry.get("by_sms", {}).items():
        if config_of(fields).num_sms != int(num_sms):
            raise ValueError(f"by_sms[{num_sms}] has num_sms={fields['num_sms']}")


def _parse(text: str) -> dict:
    """The valid entries of a cache file's text; ValueError naming what is wrong with the file itself."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError('not a config cache (no "entries" object)')
    if data.get("version") != VERSION:
        raise ValueError(f"version {data.get('version')!r}, this moe_ep reads version {VERSION}")
    entries, bad = {}, []
    for key, entry in data["entries"].items():
        try:
            _check_entry(entry)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            bad.append(f"{key!r} ({type(e).__name__}: {e})")
            continue
        entries[key] = entry
    if bad:
        warnings.warn(f"moe_ep config cache: ignoring invalid entries: {'; '.join(bad)}", stacklevel=4)
    return entries


def read_entries(path: Optional[Path] = None) -> dict:
    """The entries of the cache at path (default: cache_path()), read once per process: {} where there is
    no file, and {} with one warning where it is not a cache (the defaults apply)."""
    path = cache_path() if path is None else Path(path)
    if path is None:
        return {}
    entries = _read.get(path)
    if entries is None:
        try:
            entries = _parse(path.read_text())
        except FileNotFoundError:
            entries = {}
        except (OSError, ValueError, UnicodeDecodeError) as e:
            warnings.warn(f"moe_ep config cache {path} is unreadable ({type(e).__name__}: {e}); using the "
                          f"default configs (rewrite it with `moe-ep-bench tune`, or point {CACHE_ENV} elsewhere)",
                          stacklevel=3)
            entries = {}
        _read[path] = entries
    return entries


def write_entries(new_entries: dict, path: Optional[Path] = None) -> Path:
    """Merges new_entries into the cache at path (default: cache_path()): entries of other keys stay, those
    of the same key are replaced. Atomic: a temporary file in the same folder, then a rename, so a reader
    sees the old file or the new one. Returns the path."""
    path = cache_path() if path is None else Path(path)
    if path is None:
        raise ValueError(f"{CACHE_ENV} is empty (no cache): give a path to write to")
    for key, entry in new_entries.items():
        _check_entry(entry)
    try:
        entries = _parse(path.read_text())
    except FileNotFoundError:
        entries = {}
    except (OSError, ValueError, UnicodeDecodeError) as e:
        warnings.warn(f"moe_ep config cache {path} is unreadable ({type(e).__name__}: {e}); replacing it",
                      stacklevel=2)
        entries = {}
    entries.update(new_entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _read.pop(path, None)
    return path


def tuned_config(kind: str, num_ranks: int, num_sms: int, default_num_sms: int) -> Optional[Config]:
    """The cached Config of `kind` for num_ranks ranks on this machine, or None without one. num_sms is
    the caller's SM budget (Buffer.num_sms): at default_num_sms (never set) the tuned budget is taken with
    its chunks; another budget is kept, with the chunks tuned at it, else the tuned config's."""
    entries = read_entries()
    if not entries:  # no file: nothing more to read (in particular, no CUDA query)
        return None
    device, ranks_per_gpu = this_machine(num_ranks)
    entry = entries.get(entry_key(device, num_ranks, ranks_per_gpu, kind))
    if entry is None:
        return None
    if num_sms == default_num_sms:
        return config_of(entry["config"])
    fields = entry.get("by_sms", {}).get(str(num_sms), entry["config"])
    return config_of({**fields, "num_sms": num_sms})
