"""The shared secret between a run's trainer and its generation servers.

Every request to a rollout server (or the HF generation process) but a bare /health carries
`Authorization: Bearer TOKEN`. Where the token comes from, first found wins:

1. `PLAIT_ROLLOUT_TOKEN` in the environment;
2. the token file (`rollout.vllm.token_file` / `plait rollout-server --token-file`), by default
   ~/.cache/plait/rollout-token: whichever of server and trainer starts first creates it with a
   random token, readable by its owner only, and the other reads it.

Servers plait starts itself (the HF generation process, the Ray launcher's replicas) get a
fresh token per run through the environment; it is never written to the run directory nor put
on a command line, where `ps` would show it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path


ENV = "PLAIT_ROLLOUT_TOKEN"


class TokenError(RuntimeError):
    """The token file can't be read or created."""


def default_token_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait" / "rollout-token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _read(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(f"can't read the rollout token file {path}: {e.strerror}") from None
    if not token:
        raise TokenError(f"the rollout token file {path} is empty: delete it (a new one is made) or write a token in")
    return token


def resolve_token(token_file: str | os.PathLike | None = None) -> tuple[str, str]:
    """(token, where it came from): the environment, else the token file, created with a random
    token (mode 0600) when it does not exist yet."""
    if os.environ.get(ENV, "").strip():
        return os.environ[ENV].strip(), f"${ENV}"
    path = Path(token_file).expanduser() if token_file else default_token_file()
    if path.exists():
        return _read(path), str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # the other side created it in the meantime
        return _read(path), str(path)
    except OSError as e:
        raise TokenError(
            f"can't create the rollout token file {path}: {e.strerror} (set {ENV}, or rollout.vllm.token_file / "
            "--token-file to a writable place)"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(new_token() + "\n")
    return _read(path), str(path)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def token_matches(header: bytes | str | None, token: str) -> bool:
    """Constant-time check of an Authorization header against the token."""
    if header is None:
        return False
    given = header.encode("latin-1") if isinstance(header, str) else header
    return hmac.compare_digest(given, f"Bearer {token}".encode())
