"""Keep credentials out of configs, logs, results and dashboards.

Two rules, applied together by :func:`scrub_secrets` (and to command lines by
:func:`scrub_argv`):

* **by name**: a mapping entry whose key has a word ``key``, ``apikey``, ``token``, ``secret``,
  ``password`` or ``passwd`` (``WANDB_API_KEY``, ``hf_token``, ``apiKey``; not ``tokenizer`` or
  ``max_tokens``) has its value replaced by :data:`REDACTED`. Use it on *configurations* only:
  model state and per-layer reports legitimately have keys such as ``attention.self.key``.
* **by value**: any string that contains the value of a secret-named environment variable (at
  least 8 characters, e.g. the real ``WANDB_API_KEY``) has that value replaced, wherever it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

REDACTED = "<redacted>"
"""What a scrubbed value is replaced by."""

_SECRET_WORD = re.compile(r"(?:^|_)(?:api_?key|key|token|secret|password|passwd)(?:$|_)")
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_MIN_SECRET_CHARS = 8


def is_secret_name(name: str) -> bool:
    """Whether a key or variable name looks like it holds a credential.

    Args:
        name: A mapping key or environment variable name; camelCase, ``-``, ``.`` and spaces
            count as word boundaries like ``_``.

    Returns:
        True when one of its words is key, apikey/api_key, token, secret, password or passwd.
    """
    words = _CAMEL_BOUNDARY.sub("_", name).lower()
    return bool(_SECRET_WORD.search(re.sub(r"[^a-z0-9]+", "_", words)))


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret-named environment variables worth searching for.

    Args:
        environ: The environment; ``os.environ`` when None.

    Returns:
        The values of at least 8 characters, longest first (so overlapping secrets are fully
        replaced).
    """
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= _MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def scrub_secrets(value: Any, *, by_name: bool = True,
                  environ: Mapping[str, str] | None = None) -> Any:
    """Return a copy of ``value`` with credentials redacted.

    Args:
        value: Nested mappings, lists and tuples of plain values (other objects pass through).
        by_name: Also redact the values of secret-named keys (see the module docstring).
        environ: The environment whose secret values are searched for; ``os.environ`` if None.

    Returns:
        The scrubbed copy; mappings become plain dicts, tuples stay tuples.
    """
    secrets = environment_secrets(environ)

    def walk(item: Any) -> Any:
        if isinstance(item, Mapping):
            return {k: REDACTED if by_name and isinstance(k, str) and is_secret_name(k)
                    else walk(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return type(item)(walk(v) for v in item)
        if isinstance(item, str):
            for secret in secrets:
                item = item.replace(secret, REDACTED)
        return item

    return walk(value)


def scrub_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """A copy of a command line with credentials redacted.

    Secret values from the environment are replaced wherever they appear (by value); the value
    of a ``NAME=VALUE`` or ``--NAME=VALUE`` word, and the word after a ``--NAME`` option, are
    replaced when ``NAME`` is secret-named (``--set api_key=...``, ``--hf-token ...``).

    Args:
        argv: The words of the command line (e.g. ``sys.argv``).
        environ: The environment whose secret values are searched for; ``os.environ`` if None.

    Returns:
        The scrubbed words.
    """
    clean: list[str] = []
    redact_next = False
    for word in scrub_secrets(list(argv), by_name=False, environ=environ):
        if redact_next:
            clean.append(REDACTED)
            redact_next = False
            continue
        option = word.startswith("-")
        name, sep, _ = word.lstrip("-").partition("=")
        if sep and is_secret_name(name):
            clean.append(word[:len(word) - len(word.lstrip("-"))] + f"{name}={REDACTED}")
            continue
        redact_next = option and not sep and is_secret_name(name)
        clean.append(word)
    return clean
