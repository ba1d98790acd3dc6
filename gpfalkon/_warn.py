"""Warnings attributed to the user's line: :func:`warn_caller`.

``warnings.warn(..., stacklevel=k)`` names the frame ``k`` levels up, but one warning in gpfalkon is reached at
different depths: a CG warning through :func:`~gpfalkon.falkon_solve` is three frames below the user's call,
through ``FalkonGP.fit`` seven, through ``FalkonModel.fit`` eight, and a hook inside ``torch.nn.Module.load_state_dict``
sits at a depth that grows with the module's nesting. No fixed level names the user's line on every path.
:func:`warn_caller` walks out instead: from its caller up past every frame in gpfalkon and in the libraries it runs
inside (torch, GPyTorch, linear_operator, BoTorch, and ``contextlib`` / ``functools`` wrappers), and warns at the
first frame outside them. Written here because Python 3.11's ``warnings`` has no such option (3.12's
``skip_file_prefixes`` skips files by prefix, the same idea; gpfalkon supports 3.10+). Cost: one step per frame.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from types import FrameType


def _package_dir(name: str) -> str | None:
    """The directory of the installed package ``name`` (with a trailing separator), or ``None``."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return None if path is None else os.path.dirname(os.path.realpath(path)) + os.sep


#: frames in these directories are the library's, not the user's (resolved on the first warning: the libraries
#: are imported by then)
_LIBRARIES = ("gpfalkon", "torch", "gpytorch", "linear_operator", "botorch")
#: wrapper modules whose frames stand between a decorated function and its caller
_WRAPPERS = {os.path.realpath(contextlib.__file__), os.path.realpath(functools.__file__)}


@functools.lru_cache(maxsize=4096)
def _internal(filename: str) -> bool:
    """Whether a frame of ``filename`` belongs to gpfalkon, a library it runs inside, or a wrapper module."""
    path = os.path.realpath(filename)
    if path in _WRAPPERS:
        return True
    return any(root is not None and path.startswith(root) for root in map(_package_dir, _LIBRARIES))


def caller_level(frame: FrameType | None) -> int:
    """The ``stacklevel``, counted from the frame ``frame`` (level 1), of the first frame outside gpfalkon and the
    libraries it runs inside; past the outermost frame where every frame is theirs."""
    level = 1
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside gpfalkon and the libraries it runs
    inside: the user's line that called gpfalkon, whatever the depth of the call."""
    # level 1 is this function's frame, 2 its caller's (in gpfalkon), from which the walk starts
    warnings.warn(message, category, stacklevel=1 + caller_level(sys._getframe(1)))
