"""Who may use the console: the users of ``[postbox.console.users]``, each a ``viewer`` (reads) or
an ``operator`` (reads and acts), signing in with a password (stored as an scrypt hash) or a token
read from an environment variable. There is no anonymous access: every page but the sign-in page
needs a signed-in user, and every action an operator."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request

from postbox.config.settings import ConsoleOptions
from postbox.errors import ConfigError

__all__ = ["User", "Users", "hash_password", "verify_password"]

Role = Literal["viewer", "operator"]
_N, _R, _P = 2**14, 8, 1


def hash_password(password: str) -> str:
    """``scrypt$N$r$p$salt$hash`` (base64), for ``password_hash`` in the settings."""
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_N, r=_R, p=_P, dklen=32)
    b64 = base64.b64encode
    return f"scrypt${_N}${_R}${_P}${b64(salt).decode()}${b64(digest).decode()}"


def verify_password(stored: str, given: str) -> bool:
    """Whether ``given`` matches the scrypt hash ``stored`` (False for a malformed hash)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        got = hashlib.scrypt(
            given.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p), dklen=len(expected)
        )
    except ValueError:
        return False
    return hmac.compare_digest(got, expected)


@dataclass(frozen=True)
class User:
    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role == "operator"


class Users:
    """The configured users; refuses a configuration nobody can sign in with."""

    def __init__(self, options: ConsoleOptions) -> None:
        self._users = dict(options.users)
        for name, u in self._users.items():
            if (u.password_hash is None) == (u.token_env is None):
                raise ConfigError(
                    f"[postbox.console.users.{name}] needs exactly one of password_hash or token_env"
                )
            if u.password_hash is not None and not u.password_hash.get_secret_value().startswith("scrypt$"):
                raise ConfigError(
                    f"[postbox.console.users.{name}] password_hash is not an scrypt hash: make one with "
                    "'postbox console --hash-password'"
                )
        if not self._users:
            raise ConfigError(
                "the console has no users: add [postbox.console.users.NAME] tables (role viewer or "
                "operator; password_hash or token_env) to the configuration file; it never runs "
                "without sign-in"
            )

    def authenticate(self, name: str, secret: str) -> User | None:
        """The user, if ``secret`` is their password or token."""
        u = self._users.get(name)
        if u is None or not secret:
            return None
        if u.password_hash is not None:
            ok = verify_password(u.password_hash.get_secret_value(), secret)
        else:
            token = os.environ.get(u.token_env or "") or None
            ok = token is not None and hmac.compare_digest(token.encode(), secret.encode())
        return User(name, u.role) if ok else None

    def current(self, request: Request) -> User | None:
        """The signed-in user of this request (its role as configured now, not as when signed in)."""
        name = request.session.get("user")
        u = self._users.get(name) if isinstance(name, str) else None
        return User(str(name), u.role) if u is not None else None
