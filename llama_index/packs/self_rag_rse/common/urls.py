"""URLs as the package writes them: never with a password in them.

A server URL may carry credentials (``http://user:secret@host/v1``). Whatever the package writes
for people to read (error messages, logs, reports) goes through :func:`mask_url`, so the secret
stays where the user put it.
"""

from __future__ import annotations

import re

#: What stands in the place of a URL's password (or of a user name given alone).
MASK = "***"

#: A URL's scheme and user, then ``:password@``: the password runs to the last ``@`` before the
#: path, query or fragment (it may hold an unescaped ``@``; they start at ``/``, ``?`` or ``#``).
_PASSWORD = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*):[^\s/?#]*@")
#: A URL's scheme, then a user name without a password and ``@``.
_USER_ALONE = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#@:]+@")


def mask_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it masked: ``http://user:pw@host/v1`` ->
    ``http://user:***@host/v1``.

    ``text`` is a URL or a message that holds some. A user name given without a password is
    masked too (it is often a token). Text without userinfo comes back unchanged.
    """
    masked = _PASSWORD.sub(rf"\1:{MASK}@", text)
    return _USER_ALONE.sub(rf"\1{MASK}@", masked)
