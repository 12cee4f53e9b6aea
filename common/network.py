"""The Hugging Face Hub out of reach: told apart from every other failure, and said in one line by every command.

Each library on the way to the Hub says "unreachable" in its own way, none of them as an `OSError`:
  - huggingface_hub 2.x sends its requests through httpx2 (1.x through httpx): a connection that fails raises
    its `ConnectError` or `TimeoutException`, both `TransportError`s (subclasses of `Exception` only);
  - its downloads (`snapshot_download`, `hf_hub_download`) then look in the local cache and, missing there, raise
    `LocalEntryNotFoundError` whose cause is that transport error;
  - transformers turns that into an `OSError` ("We couldn't connect to ..."), with the chain kept; datasets into a
    builtin `ConnectionError` ("Couldn't reach ... on the Hub"), sometimes with the chain cut (`from None`);
  - requests and aiohttp (fsspec's HTTP files) raise connection errors of their own.
`network_failure(err)` finds any of them in `err` or in the exceptions it was raised from; `hub_unreachable` is
the one line every command prints for it, naming the endpoint (HF_ENDPOINT) and what to do. Deliberate offline
mode (`OfflineModeIsEnabled`, itself a `ConnectionError`) is no network failure: callers say "offline" instead.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator

from common.errors import UserError

RETRY_LOGGER = "huggingface_hub.utils._http"  # where huggingface_hub's `http_backoff` notes each retry


def _network_error_types() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the connection failed or timed out", of the HTTP stacks loaded in this
    process (a type of a library not imported cannot have been raised, so nothing is imported here)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]  # socket-level, and datasets' wrapper
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests", "ConnectionError"), ("requests", "Timeout"),
                         ("aiohttp", "ClientConnectionError"), ("aiohttp", "ServerTimeoutError")):
        if (loaded := sys.modules.get(module)) is not None and isinstance(found := getattr(loaded, name, None), type):
            types.append(found)
    return tuple(types)


def network_failure(err: BaseException) -> BaseException | None:
    """The failed connection or timeout at the root of `err` (itself, or what it was raised from or while
    handling), or None when `err` is something else. Offline mode and our own `UserError`s are not one."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    types, seen = _network_error_types(), set()
    while err is not None and id(err) not in seen and not isinstance(err, (UserError, OfflineModeIsEnabled)):
        if isinstance(err, types):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def offline_mode() -> bool:
    """Whether Hub access is switched off on purpose (HF_HUB_OFFLINE, or datasets' HF_DATASETS_OFFLINE)."""
    from huggingface_hub import constants

    datasets_config = sys.modules.get("datasets.config")  # datasets reads HF_DATASETS_OFFLINE at its import
    return bool(constants.HF_HUB_OFFLINE or getattr(datasets_config, "HF_HUB_OFFLINE", False))


def hub_unreachable(err: BaseException, what: str, instead: str, cached_copy: bool = True) -> UserError:
    """The one line for a network failure (`network_failure(err)` is not None) while trying to `what` ("read
    Hub dataset x/y"): the endpoint, the error, then what to do: check the network or HF_ENDPOINT, or use a copy
    in the local Hub cache (a read: `cached_copy`), or `instead` (the way that needs no Hub)."""
    from huggingface_hub import constants

    if offline_mode():  # a library that reports offline mode as a plain ConnectionError (datasets)
        return UserError(f"cannot {what} from the Hub: offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set) and "
                         f"not in the local cache; unset it where the Hub is reachable, or {instead}")
    cause = network_failure(err) or err
    detail = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return UserError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} to {what} ({type(cause).__name__}"
                     f"{': ' + detail if detail else ''}); check the network or HF_ENDPOINT, or "
                     + ("set HF_HUB_OFFLINE=1 to use a copy in the local Hub cache, or " if cached_copy else "")
                     + instead)


@contextmanager
def reaching_the_hub(what: str, instead: str) -> Iterator[None]:
    """Run a block that talks to the Hub: a network failure in it becomes `hub_unreachable`'s one line; every other
    error goes through as it was.

    huggingface_hub retries a download it finds neither on the Hub nor in the cache 5 times, 23 s in all, with a
    warning for each try ("'[Errno 111] Connection refused' thrown while requesting HEAD ...", "Retrying in 4s"):
    inside the block those notes are dropped, so that what the user reads is the one line (or nothing, when a retry
    gets through)."""
    retry_notes = logging.getLogger(RETRY_LOGGER)
    retry_notes.addFilter(_drop)
    try:
        yield
    except Exception as err:
        if network_failure(err) is None:
            raise
        raise hub_unreachable(err, what, instead) from None
    finally:
        retry_notes.removeFilter(_drop)


def _drop(record: logging.LogRecord) -> bool:
    return False

