"""The store's default token for one host (docs/exposure.md), shared by server and clients.

``kvstore serve`` without a tokens file still requires a bearer token: a random one kept
in a file only its user can read, at ``default_token_path()``:

* ``$KVSTORE_TOKEN_PATH`` when set, else ``$XDG_STATE_HOME/kvstore/token``, else
  ``~/.local/state/kvstore/token``.
* ``ensure_token(path)`` (the server) creates the directory 0700 and the file 0600 once
  (32 random bytes, hex; written to a temp file and hard-linked into place, so two servers
  starting together agree on one token and a reader never sees half of it) and reuses it
  afterwards, as notebook servers do.  A file or directory owned by another uid, or a
  symlink in their place, is refused (``ConfigError``); group/other bits are taken away.
* ``local_token(path)`` (clients: ``StoreClient``, the connector's remote tier, ``kvstore``
  commands) returns the token when the file exists and is readable, else None; clients
  use it only when given no token.

Another uid cannot read the file, so its calls carry no token the store knows and are
refused.  Nothing here logs or raises the token itself.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from kvstore.errors import ConfigError

PATH_ENV = "KVSTORE_TOKEN_PATH"


def default_token_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the default token lives (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get(PATH_ENV):
        return Path(env[PATH_ENV])
    state = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local" / "state")
    return Path(state) / "kvstore" / "token"


def _check_owned(path: Path, what: str, is_dir: bool) -> os.stat_result:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{what} {path} is a symlink: refused (make it a plain {'directory' if is_dir else 'file'})")
    if is_dir != stat.S_ISDIR(st.st_mode) or (not is_dir and not stat.S_ISREG(st.st_mode)):
        raise ConfigError(f"{what} {path} is not a {'directory' if is_dir else 'regular file'}")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refused")
    private = 0o700 if is_dir else 0o600
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & private)
    return st


def ensure_token(path: Path | None = None) -> str:
    """The default token at ``path``, created (0600 in a 0700 directory) if missing."""
    path = Path(path) if path is not None else default_token_path()
    directory = path.parent
    try:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_owned(directory, "default token directory", True)
        if not os.path.lexists(path):
            tmp = directory / f".token.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, (secrets.token_hex(32) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails if another server made it meanwhile: use theirs
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        _check_owned(path, "default token file", False)
        token = _read(path)
    except OSError as err:
        raise ConfigError(f"default token file {path}: {err.strerror or err}") from err
    if token is None:
        raise ConfigError(f"default token file {path} is empty or malformed: remove it and a new one is made")
    return token


def _read(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        line = f.read(4096).split(b"\n", 1)[0].strip()
    try:
        token = line.decode("ascii")
    except UnicodeDecodeError:
        return None
    return token if token and token.isprintable() and " " not in token else None


def local_token(path: Path | None = None) -> str | None:
    """The default token for a client given none: None when the file is missing or
    unreadable (another user's, or no store ever ran here)."""
    path = Path(path) if path is not None else default_token_path()
    try:
        return _read(path)
    except OSError:
        return None


__all__ = ["PATH_ENV", "default_token_path", "ensure_token", "local_token"]
