"""DynamoDB's requests as dmutex sends them, and its replies as dmutex reads them: no I/O.

Rules:

1. Every request is one of the client's operations called with keyword
   arguments (botocore's names), as a :class:`~dmutex._core.effects.Call`;
   the sync driver gets a dictionary back, the asyncio driver an
   awaitable of one.
2. A failed condition is the one error that means "not so": an exception
   whose ``response["Error"]["Code"]`` is
   ``ConditionalCheckFailedException`` (botocore's ``ClientError``, read
   by its shape: dmutex imports nothing of botocore). Every other error
   is the caller's to see.
3. Item attributes are written and read in DynamoDB's typed JSON: a
   string ``{"S": text}``, a number ``{"N": "<decimal>"}``. A reply that
   is not of that shape raises :class:`~dmutex.DMutexError`.
4. Reads that decide are strongly consistent (``ConsistentRead``): an
   eventually consistent read may miss a write that was acknowledged.
5. A batch read's reply must carry ``Responses``: botocore reads a reply
   torn inside its headers as an empty one, which must not read as "no
   items". A batch read asks for at most :data:`BATCH_KEYS` items a request (the
   service's bound) and asks again for the keys the reply says it left
   unprocessed (throttling), after a pause that doubles from
   :data:`UNPROCESSED_PAUSE`, at most :data:`UNPROCESSED_TRIES` times in a
   row before it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..._core.effects import Call, Sleep, Steps
from ..._errors import DMutexError

CONDITION_FAILED = "ConditionalCheckFailedException"
NOT_FOUND = "ResourceNotFoundException"
IN_USE = "ResourceInUseException"

BATCH_KEYS = 100
"""Rule 5: the most keys one BatchGetItem request may ask for."""

UNPROCESSED_PAUSE = 0.05
UNPROCESSED_TRIES = 8

Item = Mapping[str, object]


def error_code(error: BaseException) -> str | None:
    """The service's error code of ``error`` (rule 2), or None if it carries none."""
    response = getattr(error, "response", None)
    if isinstance(response, Mapping):
        details = response.get("Error")
        if isinstance(details, Mapping):
            code = details.get("Code")
            if isinstance(code, str):
                return code
    return None


def string(text: str) -> dict[str, str]:
    """A string attribute value (rule 3)."""
    return {"S": text}


def number(value: int) -> dict[str, str]:
    """A number attribute value (rule 3)."""
    return {"N": str(value)}


def read_string(item: Item, name: str) -> str | None:
    """The string attribute ``name`` of ``item``; None if it has none or another type."""
    value = item.get(name)
    if isinstance(value, Mapping) and isinstance(value.get("S"), str):
        return str(value["S"])
    return None


def read_number(item: Item, name: str) -> int | None:
    """The integer attribute ``name`` of ``item``; None if none, of another type, or not whole."""
    value = item.get(name)
    if not isinstance(value, Mapping) or not isinstance(value.get("N"), str):
        return None
    try:
        return int(str(value["N"]))
    except ValueError:
        return None


def reply(answer: object, operation: str) -> Mapping[str, object]:
    """``answer`` as the dictionary every operation answers (rule 3)."""
    if not isinstance(answer, Mapping):
        raise DMutexError(f"unexpected reply from DynamoDB {operation}: {answer!r}")
    return answer


def item_of(answer: object, operation: str, field: str = "Item") -> Item | None:
    """The item of a reply's ``field`` (GetItem's ``Item``), or None where it has none."""
    found = reply(answer, operation).get(field)
    if found is None:
        return None
    if not isinstance(found, Mapping):
        raise DMutexError(f"unexpected {field} from DynamoDB {operation}: {found!r}")
    return found


def key_of(name: str) -> dict[str, dict[str, str]]:
    """The primary key of the item named ``name`` (the table's partition key ``key``)."""
    return {"key": string(name)}


def batch_get(
    batch_get_item: Callable[..., object], table: str, names: Sequence[str]
) -> Steps[dict[str, Item]]:
    """The items of ``names`` that exist, by name: strongly consistent, in batches (rules 4-5)."""
    found: dict[str, Item] = {}
    for start in range(0, len(names), BATCH_KEYS):
        keys: list[object] = [key_of(name) for name in names[start : start + BATCH_KEYS]]
        pause = UNPROCESSED_PAUSE
        for attempt in range(UNPROCESSED_TRIES + 1):
            request = {table: {"Keys": keys, "ConsistentRead": True}}
            answer = reply(
                (yield Call(batch_get_item, (), {"RequestItems": request})), "BatchGetItem"
            )
            # A reply without "Responses" is no answer (botocore reads a
            # reply torn inside its headers as {}): never "no items".
            responses = answer.get("Responses")
            if not isinstance(responses, Mapping):
                raise DMutexError(f"unexpected reply from DynamoDB BatchGetItem: {answer!r}")
            items = responses.get(table, [])
            if not isinstance(items, list):
                raise DMutexError(f"unexpected reply from DynamoDB BatchGetItem: {answer!r}")
            for item in items:
                name = read_string(item, "key") if isinstance(item, Mapping) else None
                if name is None:
                    raise DMutexError(f"unexpected item from DynamoDB BatchGetItem: {item!r}")
                found[name] = item
            left = _mapping(_mapping(answer.get("UnprocessedKeys", {})).get(table, {}))
            unprocessed = left.get("Keys") or []
            if not isinstance(unprocessed, list):
                raise DMutexError(f"unexpected reply from DynamoDB BatchGetItem: {answer!r}")
            keys = unprocessed
            if not keys:
                break
            if attempt == UNPROCESSED_TRIES:
                raise DMutexError(
                    f"DynamoDB left {len(keys)} keys of table {table!r} unprocessed "
                    f"{UNPROCESSED_TRIES + 1} times in a row"
                )
            yield Sleep(pause)
            pause *= 2
    return found


def _mapping(value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise DMutexError(f"unexpected part of a DynamoDB reply: {value!r}")
    return value


def scan_items(answer: object) -> list[Item]:
    """A Scan's items."""
    items = reply(answer, "Scan").get("Items", [])
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise DMutexError(f"unexpected items from DynamoDB Scan: {items!r}")
    return items
