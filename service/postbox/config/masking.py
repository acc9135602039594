"""Secrets: one masking for every output, and the host patterns of outbound HTTP."""

from __future__ import annotations

import re
import threading
from typing import Any
from urllib.parse import unquote_plus

__all__ = [
    "MASK",
    "host_pattern",
    "is_secret_name",
    "mask_secrets",
    "mask_text",
    "mask_url",
    "register_secret",
    "register_secrets_in",
    "register_url_secrets",
    "split_hosts",
]


def split_hosts(value: Any) -> Any:
    """``"a.example, b.example"`` (as the environment gives it) as a list."""
    if isinstance(value, str):
        return [h.strip() for h in value.split(",") if h.strip()]
    return value


def host_pattern(entry: str) -> str:
    """An entry of ``http_allowed_hosts``, checked and normalised: a host name (``hooks.example.com``),
    a wildcard for its subdomains (``*.example.com``), an IP address or an IP network in CIDR form
    (``10.1.0.0/16``). Raises ValueError naming what is wrong."""
    import ipaddress

    text = entry.strip().lower().rstrip(".")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text:
        raise ValueError("an empty host in http_allowed_hosts")
    if "://" in text:
        raise ValueError(f"{entry!r} in http_allowed_hosts: give the host only, without scheme, port or path")
    if "/" in text:
        try:
            return str(ipaddress.ip_network(text, strict=False))
        except ValueError:
            raise ValueError(
                f"{entry!r} in http_allowed_hosts is not an IP network such as 10.0.0.0/8"
            ) from None
    name = text.removeprefix("*.")
    if "*" in name or not re.fullmatch(r"[\w.:\-]+", name):
        raise ValueError(
            f"{entry!r} in http_allowed_hosts is not a host name, *.domain, IP address or network "
            "(give hosts without scheme, port or path)"
        )
    if ":" in name:  # only an IPv6 address has colons here (no ports)
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise ValueError(f"{entry!r} in http_allowed_hosts: give the host without a port") from None
    return text


# --- secrets: one masking for every output -------------------------------------------------------
#
# Secrets are found by their structure: the password (or NATS token) in a URL of any scheme, query
# parameters and ``name=value`` / ``name: value`` pairs (connection strings, headers, JSON) whose
# name looks secret, and values whose setting name looks secret. On top of that, every secret the
# configuration holds (URL passwords, HMAC secrets, secret header values) is registered when loaded
# and replaced wherever it appears, even in text with no structure (a server echoing it back).

MASK = "***"

# Names (of settings, headers, query parameters, fields) that hold secrets.
_SENSITIVE_WORDS = (
    r"pass|pwd|secret|token|auth|credential|cookie|signature|session"
    r"|(?:api|access|private|signing|encryption|client|master|subscription|account|hmac)_?key"
)
_SECRET_NAME = re.compile(_SENSITIVE_WORDS)
# In a URL's query string, these names too (``?key=…`` API keys, ``?sig=…`` signed URLs).
_SECRET_QUERY_NAMES = frozenset({"key", "sig", "x_goog_signature"})
# Schemes whose user part alone (``nats://TOKEN@host``) is a token.
_TOKEN_USER_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_PAIR = re.compile(
    r"(?<![\w.\-])"
    r"(?P<name>(?=[\w.\-]*?(?:" + _SENSITIVE_WORDS.replace("_?", "[_\\-]?") + r"))[\w.\-]+)"
    # "=" as in connection strings and queries; ":" followed by a space or a quote, as in headers,
    # YAML and JSON (not "auth:login", which is more likely a name than a secret).
    r"(?P<q>[\"']?)(?P<sep>[ \t]*(?:=[ \t]*|:[ \t]+|:(?=[\"'])))"
    r"(?P<scheme>(?:bearer|basic|token|digest)[ \t]+)?"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s&,;\"'})\]]+)",
    re.IGNORECASE,
)


# Secrets registered from the configuration, longest first (a secret holding another is masked
# whole). Replaced as a whole tuple, so that readers in other threads never see it change.
class _Known:
    secrets: tuple[str, ...] = ()
    lock = threading.Lock()


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def is_secret_name(name: str) -> bool:
    """Whether a setting, header, field or parameter named ``name`` holds a secret (a name ending
    in ``_env`` holds the name of an environment variable, not the secret)."""
    n = _normal(name)
    return not n.endswith("_env") and bool(_SECRET_NAME.search(n))


# Shorter registered values are masked by structure only: replacing a short word everywhere (a
# password "postbox" in "postbox.worker") would garble the output.
_MIN_REGISTERED = 8


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever it appears in this process's output from now on (values of at least
    8 characters; shorter ones are masked where their structure shows them)."""
    if not value:
        return
    values = {v for v in (value, unquote_plus(value)) if len(v) >= _MIN_REGISTERED and MASK not in v}
    with _Known.lock:
        if values - set(_Known.secrets):
            _Known.secrets = tuple(sorted(values | set(_Known.secrets), key=len, reverse=True))


def register_url_secrets(text: str) -> None:
    """Register the secrets of every URL (and ``password=…`` pair) in ``text``."""
    for match in _URL.finditer(text):
        url = match.group(0)
        scheme, _, rest = url.partition("://")
        userinfo = _userinfo(rest)
        if userinfo is not None:
            user, colon, password = userinfo.partition(":")
            register_secret(password if colon else user if scheme.lower() in _TOKEN_USER_SCHEMES else None)
        query = rest.partition("?")[2]
        for part in re.split(r"[&;#]", query):
            name, eq, value = part.partition("=")
            if eq and _secret_param(name):
                register_secret(value)
    for pair in _PAIR.finditer(text):
        if not pair.group("name").lower().endswith("_env"):
            register_secret(pair.group("value").strip("\"'"))


def _userinfo(rest: str) -> str | None:
    """The user information of a URL without its ``scheme://``, or None."""
    end = len(rest)
    for ch in "?#":
        i = rest.find(ch)
        if i != -1:
            end = min(end, i)
    at = rest.rfind("@", 0, end)
    return rest[:at] if at != -1 else None


def _secret_param(name: str) -> bool:
    name = unquote_plus(name)
    return is_secret_name(name) or _normal(name) in _SECRET_QUERY_NAMES


def _mask_params(text: str) -> str:
    parts = re.split(r"([&;])", text)
    for i, part in enumerate(parts):
        name, eq, value = part.partition("=")
        if eq and value and _secret_param(name):
            parts[i] = f"{name}={MASK}"
    return "".join(parts)


def _mask_one_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    userinfo = _userinfo(rest)
    if userinfo is not None:
        user, colon, _password = userinfo.partition(":")
        if colon:
            rest = f"{user}:{MASK}" + rest[len(userinfo) :]
        elif scheme.lower() in _TOKEN_USER_SCHEMES and user:
            rest = MASK + rest[len(userinfo) :]
    start = rest.find("?")
    if start == -1:
        start = rest.find("#")
    if start != -1:
        rest = rest[: start + 1] + "#".join(_mask_params(p) for p in rest[start + 1 :].split("#"))
    return f"{scheme}://{rest}"


def _mask_pair(match: re.Match[str]) -> str:
    if match.group("name").lower().endswith("_env"):
        return match.group(0)
    value = match.group("value")
    masked = f"{value[0]}{MASK}{value[0]}" if value[0] in "\"'" else MASK
    return (
        match.group("name") + match.group("q") + match.group("sep") + (match.group("scheme") or "") + masked
    )


def mask_text(text: str) -> str:
    """``text`` with every secret masked: passwords (and NATS tokens) in URLs of any scheme, secret
    query parameters, ``password=…``-like pairs (connection strings, headers, JSON), and every
    secret registered from the configuration. The one masking function of every output."""
    if not text:
        return text
    if "://" in text:
        text = _URL.sub(lambda m: _mask_one_url(m.group(0)), text)
    if "=" in text or ":" in text:
        text = _PAIR.sub(_mask_pair, text)
    for secret in _Known.secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def mask_url(url: str) -> str:
    """The URL (or libpq connection string) with its secrets masked, for logs and messages."""
    return mask_text(url)


def mask_secrets(value: Any, name: str = "") -> Any:
    """``value`` (a settings document: dicts, lists, scalars) with secrets masked: any value whose
    name looks secret (password, secret, token, key, signature, auth…), and secrets inside every
    string (see :func:`mask_text`)."""
    secret = is_secret_name(name)
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) if not secret else _all_masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_all_masked(v) if secret else mask_secrets(v, name) for v in value]
    if secret and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return mask_text(value)
    return value


def _all_masked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _all_masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_all_masked(v) for v in value]
    return MASK if value not in (None, "") else value


def register_secrets_in(value: Any, name: str = "") -> None:
    """Register for masking every secret of a parsed table: URLs' passwords, tokens and secret
    parameters in any string, and the values of settings and headers named like secrets."""
    if isinstance(value, dict):
        for k, v in value.items():
            register_secrets_in(v, str(k))
    elif isinstance(value, list | tuple):
        for v in value:
            register_secrets_in(v, name)
    elif isinstance(value, str):
        if is_secret_name(name):
            register_secret(value)
            register_secret(value.partition(" ")[2])  # "Bearer <token>"
        register_url_secrets(value)
