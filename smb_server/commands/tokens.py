"""Where a command finds its credential: the client token of ``smb status`` and ``smb
region``, the operator's admin credential, and the warning when a token came on the
command line."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from smb_server.runtime.config import ConfigError, load_secret
from smb_server.runtime.credentials import admin_credential

log = logging.getLogger(__name__)


def warn_token_flag(args: argparse.Namespace, command: str) -> None:
    """Say so when the token came on the command line, where every user of the host sees it."""
    if getattr(args, "token", None):
        print(f"smb {command}: warning: --token is visible to every user of this host (ps); "
              "set SMB_TOKEN or the config file's token instead", file=sys.stderr)


def client_token(args: argparse.Namespace) -> str:
    """The client token of ``smb status``/``smb region``: --token, else $SMB_TOKEN."""
    warn_token_flag(args, args.command)
    return str(args.token) if args.token is not None else os.environ.get("SMB_TOKEN", "")


def admin_token(secret_file: str = "") -> str:
    """The operator's credential: ``$SMB_ADMIN_TOKEN``, the file ``$SMB_ADMIN_TOKEN_FILE``
    names, or the one derived from the shared secret (``secret_file`` or
    ``$SMB_SECRET``); "" when none is at hand. Never taken from the command line."""
    token = os.environ.get("SMB_ADMIN_TOKEN", "")
    path = os.environ.get("SMB_ADMIN_TOKEN_FILE", "")
    if not token and path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"admin token file {path} (SMB_ADMIN_TOKEN_FILE): {exc.strerror}") from None
    if not token:
        secret = load_secret(secret_file)
        if secret:
            token = admin_credential(secret)
    return token
