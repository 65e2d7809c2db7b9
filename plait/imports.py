"""The user's code named in a config: `module:attribute`, where the module is a dotted name
(installed, on PYTHONPATH, or in the current directory, as `python -m` finds it) or the path of
a `.py` file (`./rewards.py:accuracy`, `/abs/dir/judges.py:Judge`)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys


def is_file(module: str) -> bool:
    return module.endswith(".py")


def file_path(module: str) -> str:
    """The absolute, resolved path of a module given as a .py file."""
    return os.path.realpath(os.path.expanduser(module))


def import_module(module: str):
    """The module named `module` (a dotted name or a .py file's path); ImportError says what
    is missing."""
    if not is_file(module):
        # Like `python -m`, the current directory is searched too (after the installed packages),
        # so a rewards.py next to the config works from the `plait` command.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())
        return importlib.import_module(module)
    path = file_path(module)
    if not os.path.isfile(path):
        raise ImportError(f"no file {path}")
    # one module per file, whatever path named it; the hash keeps two files called rewards.py apart
    name = f"plait_user_{os.path.basename(path)[:-3]}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:  # its own imports of modules beside it work, as when it runs as a script
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # before running it: dataclasses and pickle look their module up there
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        del sys.modules[name]
        raise
    return loaded


def nearest(module, attr: str) -> str:
    """' (did you mean ...?)' naming the module's public callables closest to `attr`, or ''."""
    import difflib

    names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
    near = difflib.get_close_matches(attr, names, n=3)
    return f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
