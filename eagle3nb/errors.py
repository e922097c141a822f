"""One error path for every command: a user's mistake leaves as one line naming what is wrong, where, and the fix.

Every error the library raises for something a user can fix derives from :class:`UserError` (parameters, stage
inputs, a server that lies, a folder another run holds...). The command lines (``eagle3nb ...``,
``python -m eagle3nb.<stage>``) run through :func:`guarded`: a user error prints ``<prog>: error: <message>``
and exits 2; anything else prints one line saying it is a bug to report and exits 1; Ctrl-C / SIGTERM exit 130.
Tracebacks only when asked (``--debug`` or ``EAGLE3NB_DEBUG=1``). In a notebook (JupyterLab or papermill),
:func:`install_notebook_handler` makes a user error's cell output that same one line.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import Any, Callable

DEBUG_ENV = "EAGLE3NB_DEBUG"
MAX_LINES = 2
_CREDENTIAL = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<cred>[^/@\s]+)@")


class UserError(Exception):
    """Something the user can fix; the message names what is wrong, where (file and key, URL, row) and what to do."""


class InputError(UserError, ValueError, RuntimeError):
    """An input a command was given (a file another stage wrote, a model folder, a server's state) that cannot be
    used as it is; the message names it and the fix."""


def scrub(text: str) -> str:
    """Credentials inside URLs (``http://user:KEY@host``) replaced, so no message or log carries them."""
    return _CREDENTIAL.sub(lambda m: f"{m['scheme']}***@", text)


def has_credential(url: str) -> bool:
    return bool(_CREDENTIAL.match(url.strip()))


def debugging(argv: list[str] | None = None) -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no") or \
        "--debug" in (argv or [])


def _os_message(e: OSError) -> str | None:
    if e.errno is None and str(e):  # raised by our code with its own message
        return str(e)
    where = f"{e.filename}: " if e.filename else ""
    if e.errno == errno.ENOSPC:
        return (f"{where}no space left on the disk; free some space (or point output_dir elsewhere) and run the same "
                f"command again: what was written so far is kept and resumes")
    if isinstance(e, FileNotFoundError):
        return f"{where}no such file or folder; check the path"
    if isinstance(e, IsADirectoryError):
        return f"{where}is a folder where a file was expected; fix the path"
    if isinstance(e, NotADirectoryError):
        return f"{where}a part of this path is a file, not a folder; pick another folder"
    if isinstance(e, PermissionError):
        return f"{where}permission denied; fix the rights or pick a folder you can write"
    if isinstance(e, FileExistsError):
        return f"{where}already exists; remove it or pick another path"
    return None


def user_message(exc: BaseException) -> str | None:
    """The one- or two-line message of a user error, or None when ``exc`` is a bug."""
    if isinstance(exc, UserError):
        text = str(exc) or type(exc).__name__
    elif isinstance(exc, OSError):
        text = _os_message(exc)
        if text is None:
            return None
    elif isinstance(exc, UnicodeDecodeError):
        text = f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); pass a text file"
    else:
        return None
    lines = [ln for ln in scrub(text).splitlines() if ln.strip()]
    if len(lines) > MAX_LINES:
        lines = lines[: MAX_LINES - 1] + [f"{lines[MAX_LINES - 1]} (and {len(lines) - MAX_LINES} more)"]
    return "\n".join(lines)


def guarded(prog: str, fn: Callable[..., Any], *args: Any, argv: list[str] | None = None) -> int:
    """Run a command's body: its return code, or 2 / 1 / 130 with one line on stderr (see the module doc)."""
    try:
        return int(fn(*args) or 0)
    except SystemExit:
        raise
    except KeyboardInterrupt as e:
        print(f"{prog}: {e or 'stopped'}", file=sys.stderr)
        return 130
    except Exception as e:
        if debugging(argv):
            raise
        msg = user_message(e)
        if msg is not None:
            print(f"{prog}: error: {msg}", file=sys.stderr)
            return 2
        print(f"{prog}: internal error: {type(e).__name__}: {scrub(str(e)).splitlines()[0] if str(e) else ''} "
              f"(a bug: run again with {DEBUG_ENV}=1 for the traceback and report it)", file=sys.stderr)
        return 1


def install_notebook_handler() -> None:
    """In an IPython kernel: a UserError's cell output is its one line (the cell still fails, so papermill and
    the runner stop there); other errors keep their traceback. Nothing happens outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or debugging():
        return

    def one_line(_shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> list[str]:
        stb = [f"{etype.__name__}: {user_message(value)}"]
        _shell._showtraceback(etype, value, stb)  # IPython shows what the handler shows, and only that
        return stb

    shell.set_custom_exc((UserError,), one_line)
