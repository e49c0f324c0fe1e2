"""How an error's status travels through Triton's BLS (standard library only: the plain-request
front imports it and moves tensors, nothing more, so it stays a light process).

Triton's python backend (at least the one nvidia-pytriton ships) drops an error's status code on
the way back through BLS: the generate front would see every error as INTERNAL. So the front marks
its BLS requests with this request parameter, and the speculation model then prefixes its error
messages with the status (`tag_status`); the front strips it (`untag_status`). Clients talking
to the speculation model directly never see the prefix.
"""

from __future__ import annotations

STATUS_PARAMETER = "eagle31_status_in_message"
_STATUS_TAGS = {True: "INVALID_ARG", False: "INTERNAL"}


def tag_status(message: str, client_fault: bool) -> str:
    return f"{_STATUS_TAGS[client_fault]}|{message}"


def untag_status(message: str) -> tuple[str, bool | None]:
    """(message, client at fault) from a tagged message; (message, None) when it carries no tag
    (an error the speculation model did not compose: the caller treats it as internal)."""
    tag, sep, rest = message.partition("|")
    for client_fault, name in _STATUS_TAGS.items():
        if sep and tag == name:
            return rest, client_fault
    return message, None
